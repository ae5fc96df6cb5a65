"""What the hybrid is worth (issue 35, SPEC §11): one retrieval model trained three ways.

The same 4-layer model (the ``tiny`` preset's widths scaled to ``--width``; ``max_position_embeddings``
raised: K3 is NoPE) with three attention layouts: the K3 mix (KDA, KDA, KDA, MLA: three linear
layers per full one), all-KDA and all-MLA. Each trains with the one Trainer on the same rows (same
tokens, same seed): ``k3.rl.longctx.RetrievalBatches``, one training document per row in the
evaluation's sentence format (filler with facts, then every fact asked and answered), cut to a
length drawn up to the row, the loss on the answered questions only, and a tokenizer of the
model's vocabulary trained on such documents (saved with the run).

Then, per layout, through ``k3 eval``'s own suites:

- ``retrieve``: multi-key items at each length (trained at ``--seq-len``, evaluated up to and past
  it), depths 0 / 0.5 / 1, exact match of the greedy answer;
- ``accept``: prefill and decode at each length: decode seconds per token and the cache bytes
  (the KDA state is constant, the MLA latent cache grows with T: the notepad-vs-archive split).

Writes ``OUT/report.json`` (parameters, training tokens and loss, accuracy and cache per length,
machine, date), one JSON line per (layout, length, metric) to
``benchmarks/results/hybrid_retrieval.jsonl`` (baseline: the K3 mix at the same length) and one
plot, ``OUT/hybrid_retrieval.png``: accuracy vs length and cache bytes vs length.

    python benchmarks/hybrid_retrieval.py [--steps 2400] [--out runs/hybrid]

A layout whose training finished with the same settings (``OUT/LAYOUT.json``) is read back and
only evaluated, so layouts can train in separate processes (``--layouts k3`` and ``--layouts kda``
side by side) and a last call with every layout writes the report.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path
from statistics import mean

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
RESULTS = ROOT / "benchmarks" / "results" / "hybrid_retrieval.jsonl"
LAYOUTS = {"k3": ([1, 2, 3], [4]), "kda": ([1, 2, 3, 4], []), "mla": ([], [1, 2, 3, 4])}


def model_overrides(layout: str, max_positions: int, width: int = 256) -> dict:
    """The scaling study's shape at ``width`` (``k3_shape``: the tiny preset's widths scaled, heads of
    64) with 4 layers in ``layout``."""
    from scaling import k3_shape

    shape = k3_shape(width)
    kda, full = LAYOUTS[layout]
    return {**shape, "num_hidden_layers": 4, "attn_res_block_size": 2, "max_position_embeddings": max_positions,
            "linear_attn_config": {**shape["linear_attn_config"], "kda_layers": kda, "full_attn_layers": full}}


def tokenizer_for(a, vocab_size: int):
    """A byte-level BPE of the model's vocabulary trained on ``a.docs`` training documents with
    the full filler (the format, the names and the digits get their merges)."""
    from k3.data.tokenizer import train_tokenizer
    from k3.rl.longctx import training_document

    return train_tokenizer((training_document(i, a.seq_len, a.keys) for i in range(a.docs)), vocab_size)


def train(layout: str, a, tok, out: Path) -> dict:
    from k3.rl.longctx import RetrievalBatches
    from k3.train.config import TrainConfig
    from k3.train.loop import Trainer

    tc = TrainConfig.build(None, {
        "preset": "tiny", "model_overrides": model_overrides(layout, max(a.lengths) + 64, a.width),
        "out": str(out), "steps": a.steps, "batch_size": a.batch_size, "curriculum": [[0, a.seq_len]],
        "lr": a.lr, "warmup_frac": 0.05, "decay_frac": 0.3, "eval_interval": 0,
        "ckpt_interval": 0, "log_interval": 25, "threads": a.threads, "plot": False, "seed": 0})
    t0 = time.monotonic()
    data = RetrievalBatches(tok, a.batch_size, a.keys, seed=0, min_keys=a.min_keys)
    trainer = Trainer(tc, overwrite=True, batches=data)
    res = trainer.train()
    if res.status != "done":
        raise SystemExit(f"{layout}: training stopped ({res.status}); the run is in {out}")
    recs = [r for r in trainer.metrics.records if r["kind"] == "train"]
    return {"params": sum(p.numel() for p in trainer.model.parameters()),
            "tokens": recs[-1]["tokens"] if recs else 0, "documents": data.next_doc,
            "final_loss": recs[-1]["loss"] if recs else None, "train_s": round(time.monotonic() - t0, 1)}


def evaluate(layout: str, a, run: Path, out: Path) -> dict:
    from k3.rl.eval_rows import model_condition
    from k3.rl.eval_suites import run_accept, run_retrieve

    cond = model_condition(run)
    for suite in ("retrieve", "accept"):   # this evaluation replaces the layout's previous one
        shutil.rmtree(out / f"{layout}-{suite}", ignore_errors=True)
    rrows = run_retrieve(str(run), cond, out / f"{layout}-retrieve", a.lengths, a.depths, ["multikey"],
                         a.eval_seeds, a.keys)
    arows = run_accept(str(run), cond, out / f"{layout}-accept", a.lengths, decode_tokens=8)
    by = {(r["labels"]["T"], r["metric"]): r["value"] for r in arows}
    cells: dict = {}   # T -> depth -> correct values
    for r in rrows:
        cells.setdefault(r["labels"]["T"], {}).setdefault(str(r["labels"]["depth"]), []).append(r["value"])
    return {"accuracy": {T: mean([v for vs in cells[T].values() for v in vs]) for T in a.lengths},
            "accuracy_by_depth": {T: {d: mean(vs) for d, vs in cells[T].items()} for T in a.lengths},
            "cache_bytes": {T: by[(T, "cache_bytes")] for T in a.lengths},
            "decode_s_per_token": {T: by[(T, "decode_s_per_token")] for T in a.lengths}}


def plot(report: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax0, axd, ax1) = plt.subplots(1, 3, figsize=(15, 3.8))
    ts_all = sorted(int(t) for r in report["layouts"].values() for t in r["accuracy"])
    at = min((t for t in ts_all if t >= report["seq_len"]), default=ts_all[-1])   # the depth panel's T
    for layout, r in report["layouts"].items():
        ts = sorted(int(t) for t in r["accuracy"])
        ax0.plot(ts, [r["accuracy"][str(t)] for t in ts], marker="o", label=layout)
        ax1.plot(ts, [r["cache_bytes"][str(t)] for t in ts], marker="o", label=layout)
        by = r["accuracy_by_depth"][str(at)]
        ds = sorted(by, key=float)
        axd.plot([float(d) for d in ds], [by[d] for d in ds], marker="o", label=layout)
    ax0.axvline(report["seq_len"], color="grey", ls=":", lw=1)
    for ax in (ax0, ax1):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context length T (tokens)")
    for ax in (ax0, axd, ax1):
        ax.legend(fontsize=8)
    for ax in (ax0, axd):
        ax.set_ylim(-0.05, 1.05)
        ax.set_ylabel(f"multi-key exact match ({report['keys']} facts)")
    ax0.set_title("retrieve (dotted: training length)")
    axd.set_xlabel("depth of the queried fact (0 = start, 1 = end)")
    axd.set_title(f"retrieve at T = {at} by depth")
    ax1.set_yscale("log")
    ax1.set_ylabel("decode cache bytes")
    ax1.set_title("decode state vs context")
    fig.suptitle(f"K3 mix vs all-KDA vs all-MLA, {report['steps']} steps each; {report['machine']}, {report['date']}",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(ROOT / "runs" / "hybrid"))
    p.add_argument("--layouts", default="k3,kda,mla")
    p.add_argument("--docs", type=int, default=1000, help="documents the tokenizer is trained on")
    p.add_argument("--keys", type=int, default=4, help="facts per document and per evaluation item")
    p.add_argument("--min-keys", type=int, default=1, help="fewest facts of a training document (each draws "
                   "its count up to --keys)")
    p.add_argument("--width", type=int, default=128, help="hidden size (the tiny preset's widths scaled to it)")
    p.add_argument("--steps", type=int, default=2400)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--lengths", default="256,512,1024,2048,4096")
    p.add_argument("--depths", default="0,0.5,1")
    p.add_argument("--eval-seeds", type=int, default=24)
    p.add_argument("--threads", default="auto")
    a = p.parse_args(argv)
    a.lengths = [int(x) for x in a.lengths.split(",")]
    a.depths = [float(x) for x in a.depths.split(",")]
    a.threads = a.threads if a.threads == "auto" else int(a.threads)
    layouts = a.layouts.split(",")
    if any(x not in LAYOUTS for x in layouts):
        p.error(f"--layouts takes {', '.join(LAYOUTS)}")
    out = Path(a.out)
    from k3.config import get_preset
    tok = None   # trained when a layout trains (a read-back layout evaluates with its run's own)

    from k3.rl.eval_rows import machine
    report = {"steps": a.steps, "batch_size": a.batch_size, "seq_len": a.seq_len, "lr": a.lr, "docs": a.docs,
              "width": a.width, "min_keys": a.min_keys, "keys": a.keys, "eval_seeds": a.eval_seeds, "depths": a.depths,
              "machine": machine(), "date": time.strftime("%Y-%m-%d"), "layouts": {}}
    # a layout whose training finished with the same settings is read back, not retrained; the
    # evaluation (a minute or two) always runs
    settings = {k: v for k, v in report.items() if k not in ("machine", "date", "layouts", "eval_seeds", "depths")}
    settings["lengths"] = a.lengths   # the model's max_position_embeddings follows them
    for layout in layouts:
        done = out / f"{layout}.json"
        if done.is_file() and json.loads(done.read_text())["settings"] == settings:
            tr = json.loads(done.read_text())["train"]
            print(f"== {layout}: training read back from {done}", flush=True)
        else:
            print(f"== {layout}: training {a.steps} steps", flush=True)
            tok = tok or tokenizer_for(a, get_preset("tiny").vocab_size)
            tr = train(layout, a, tok, out / layout)
            done.write_text(json.dumps({"settings": settings, "train": tr}, indent=1) + "\n")
        ev = evaluate(layout, a, out / layout, out / "eval")
        report["layouts"][layout] = {**tr, **{k: {str(t): v for t, v in d.items()} for k, d in ev.items()}}
        print(f"   {layout}: {tr['params']:,} parameters, final loss {tr['final_loss']}, accuracy "
              + ", ".join(f"T={t}: {ev['accuracy'][t]:.2f}" for t in a.lengths), flush=True)
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    plot(report, out / "hybrid_retrieval.png")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    base = report["layouts"].get("k3")
    with open(RESULTS, "a") as f:
        for layout, r in report["layouts"].items():
            for metric in ("accuracy", "cache_bytes", "decode_s_per_token"):
                for t, v in r[metric].items():
                    b = base[metric][t] if base else None
                    f.write(json.dumps({"bench": "hybrid_retrieval", "config": f"{layout}/T={t}", "metric": metric,
                                        "value": v, "baseline": b, "ratio": v / b if b else None,
                                        "params": r["params"], "steps": a.steps, "machine": report["machine"],
                                        "date": report["date"]}) + "\n")
    print(f"report: {out / 'report.json'}; plot: {out / 'hybrid_retrieval.png'}; lines: {RESULTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
