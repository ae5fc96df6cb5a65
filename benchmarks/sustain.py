"""The sustain benchmark (docs/EVAL.md, "Sustain"): a model trained on short chains of dependent
steps, run through chains far longer than it trained on, with the harness's compaction on and off.

1. **Base**: the agent demo's base (``--base``, default ``runs/agent-base``); when it holds no
   checkpoint, ``k3 demo``'s code pretrains it with the agent base recipe (as ``k3 agent-demo``).
2. **Data**: the ``chainN`` workload's scripted solver for each N of ``--train-steps`` on training
   seeds, in real sandboxes, the harness compacting at ``--context-tokens``; one SFT row per turn
   (``k3 task synth --per-turn 1``): what that turn was sent, compacted, then the turn (the only
   one trained). The model thus learns to act from the contexts compaction leaves it.
3. **SFT**: the one Trainer from the base.
4. **Sustain**: ``k3 eval sustain`` of the SFT checkpoint (LocalEngine, greedy, effort max) for each
   N of ``--eval-steps`` on held-out seeds, compaction on (at the training limit) and off; the
   reference solution on the same seeds is the control (progress 1 in both modes).

Writes ``OUT/train.json`` (the training settings; ``--reuse`` evaluates ``OUT/sft`` again from it),
``OUT/report.json`` (per eval length × mode: the verifier's score per seed, mean progress and mean
context sent at each tenth of the 2·N calls, the call at which progress last rose, statuses;
training settings, times, machine and date), ``OUT/sustain.png`` (progress and context sent
against tool calls) and one JSON line per eval length × mode to ``benchmarks/results/sustain.jsonl``.
``python benchmarks/docs_tables.py --save-sustain OUT/report.json`` records it under docs/data and
renders its table into docs/EVAL.md.

    python benchmarks/sustain.py [--out runs/sustain] [--base runs/agent-base]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def sustained(curve: list[list]) -> int:
    """The tool call at which progress last rose (the start of the curve's final plateau): how
    long the work was sustained."""
    best, at = 0.0, 0
    for calls, _, progress in curve:
        if progress > best:
            best, at = progress, calls
    return at


def summarize(rows: list[dict], steps: int) -> dict:
    """Per compaction mode: scores per seed, mean progress and context at each tenth, sustained calls."""
    out: dict[str, dict] = {}
    for mode in ("on", "off"):
        scores = [r for r in rows if r["metric"] == "score" and r["labels"]["compaction"] == mode]
        tenths = {}
        for metric in ("progress", "sent_tokens"):
            by = {}
            for r in rows:
                if r["metric"] == metric and r["labels"]["compaction"] == mode and r["value"] is not None:
                    by.setdefault(r["labels"]["share"], []).append(r["value"])
            tenths[metric] = {str(k): statistics.fmean(v) for k, v in sorted(by.items())}
        curves = [r["detail"]["curve"] for r in scores]
        out[mode] = {"steps": steps, "seeds": [r["item"] for r in scores],
                     "score": [r["value"] for r in scores],
                     "mean_score": statistics.fmean([r["value"] or 0.0 for r in scores]),
                     "status": [r["detail"]["status"] for r in scores],
                     "calls": [c[-1][0] if c else 0 for c in curves],
                     "sustained_calls": [sustained(c) for c in curves],
                     "max_sent_tokens": [max((p[1] for p in c), default=0) for c in curves],
                     "over_context_turns": [r["detail"].get("over_context_turns", 0) for r in scores],
                     "progress": tenths["progress"], "sent_tokens": tenths["sent_tokens"],
                     "curves": curves}
    return out


def plot(report: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    colors = {"on": "tab:blue", "off": "tab:red"}
    for who, res in (("model", report["model"]), ("reference", report["reference"])):
        for n, modes in res.items():
            for mode, s in modes.items():
                for i, c in enumerate(s["curves"]):
                    if not c:
                        continue
                    x = [p[0] for p in c]
                    style = "-" if who == "model" else ":"
                    label = f"{who} N={n} compaction {mode}" if i == 0 else None
                    a.plot(x, [p[2] for p in c], style, color=colors[mode], alpha=0.7, label=label)
                    if who == "model":
                        b.plot(x, [p[1] for p in c], style, color=colors[mode], alpha=0.7, label=label)
    b.axhline(report["context_tokens"], color="gray", lw=0.8, ls="--", label="compaction limit")
    a.set(xlabel="tool calls", ylabel="progress (share of steps right)", title="Task progress")
    b.set(xlabel="tool calls", ylabel="context sent (estimated tokens)", yscale="log", title="Context sent")
    a.legend(fontsize=7)
    b.legend(fontsize=7)
    fig.suptitle(f"sustain: {report['machine']}, {report['date']}", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def train(a, out: Path, base: Path, times: dict) -> dict:
    """Pretrain the base when missing, synthesize the per-turn rows, SFT; the training settings
    (also written to ``OUT/train.json``)."""
    from k3.cli.agent_demo import _has_checkpoint
    from k3.rl.sft import SFTRows
    from k3.rl.synth import synthesize
    from k3.train.config import TrainConfig
    from k3.train.loop import Trainer

    if not _has_checkpoint(base):
        print(f"== no checkpoint in {base}: pretraining it (k3 demo's code, the agent base recipe)", flush=True)
        t0 = time.monotonic()
        from k3.cli.train import AGENT_BASE_CONFIG, AGENT_BASE_STEPS, demo_main
        if demo_main(["--out", str(base)], recipe=(AGENT_BASE_CONFIG, AGENT_BASE_STEPS)) != 0:
            raise SystemExit("sustain: the base's pretraining failed")
        times["pretrain_s"] = time.monotonic() - t0

    print(f"== SFT rows: chains of {a.train_steps} steps × {a.train_seeds} training seeds, one row per turn, "
          f"compacted at {a.context_tokens} tokens", flush=True)
    t0 = time.monotonic()
    data, synth = out / "data", {}
    for n in _ints(a.train_steps):
        rep = synthesize(f"chain{n}", range(a.train_seeds), ["max"], data / f"chain{n}.jsonl", workers=a.workers,
                         overwrite=True, per_turn=1, context_tokens=a.context_tokens)
        synth[f"chain{n}"] = {"episodes": rep.episodes, "rows": rep.rows, "failed": len(rep.failed)}
        print(f"   chain{n}: {rep.rows} rows from {rep.episodes} episodes ({len(rep.failed)} failed)", flush=True)
    times["synth_s"] = time.monotonic() - t0

    print(f"== SFT: {a.sft_steps} steps of {a.batch_size} × {a.seq_len} tokens from {base}", flush=True)
    t0 = time.monotonic()
    tc = TrainConfig.build(None, {
        "init_from": str(base), "sft_data": str(data), "out": str(out / "sft"), "steps": a.sft_steps,
        "batch_size": a.batch_size, "curriculum": [[0, a.seq_len]], "lr": a.lr, "warmup_frac": 0.05,
        "decay_frac": 0.5, "eval_interval": 0, "val_percent": 2, "ckpt_interval": 0, "threads": a.threads,
        "log_interval": 50})
    trainer = Trainer(tc, overwrite=True, read_rows=SFTRows())
    print("   " + trainer.corpus.summary(), flush=True)
    res = trainer.train()
    times["sft_s"] = time.monotonic() - t0
    trained = {"base": str(base), "train_steps": _ints(a.train_steps), "train_seeds": a.train_seeds,
               "context_tokens": a.context_tokens, "synth": synth,
               "sft": {"steps": a.sft_steps, "batch_size": a.batch_size, "seq_len": a.seq_len, "lr": a.lr,
                       **trainer.corpus.counts(), "final_val_loss": res.val["val_loss"] if res.val else None},
               "train_times": {k: round(v, 1) for k, v in times.items()}}
    (out / "train.json").write_text(json.dumps(trained, indent=1) + "\n")
    return trained


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="runs/sustain")
    p.add_argument("--base", default="runs/agent-base", help="the pretrained base (pretrained when missing)")
    p.add_argument("--train-steps", default="8,16,24,32", help="chain lengths N of the SFT episodes")
    p.add_argument("--train-seeds", type=int, default=40, help="training seeds per chain length")
    p.add_argument("--context-tokens", type=int, default=500, help="the harness's limit in training and 'on'")
    p.add_argument("--sft-steps", type=int, default=600)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--eval-steps", default="32,100", help="chain lengths N of the sustain episodes")
    p.add_argument("--eval-seeds", type=int, default=3, help="held-out seeds per eval length")
    p.add_argument("--max-tokens", type=int, default=96, help="tokens per assistant turn")
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--threads", default="1")
    p.add_argument("--results", default=str(ROOT / "benchmarks" / "results" / "sustain.jsonl"))
    p.add_argument("--reuse", action="store_true",
                   help="evaluate OUT/sft as it is: no pretraining, synthesis or SFT (its settings come from "
                        "OUT/train.json, written by the run that trained it)")
    a = p.parse_args()

    from k3.cli.agent_demo import _has_checkpoint
    from k3.rl.eval_rows import machine, model_condition
    from k3.rl.eval_suites import run_sustain
    from k3.tasks.families import HELDOUT_START

    out, base = Path(a.out), Path(a.base)
    out.mkdir(parents=True, exist_ok=True)
    times: dict[str, float] = {}
    t_all = time.monotonic()
    sft = out / "sft"
    if a.reuse:
        if not (out / "train.json").is_file() or not _has_checkpoint(sft):
            raise SystemExit(f"sustain: --reuse needs {out / 'train.json'} and a checkpoint in {sft}")
        trained = json.loads((out / "train.json").read_text())
        if trained["context_tokens"] != a.context_tokens:
            raise SystemExit(f"sustain: --context-tokens {a.context_tokens} is not the limit {sft} was trained "
                             f"at ({trained['context_tokens']}); compaction 'on' runs at the training limit")
    else:
        trained = train(a, out, base, times)
    seeds = list(range(HELDOUT_START, HELDOUT_START + a.eval_seeds))
    report: dict = {"model": {}, "reference": {}}
    cond = model_condition(sft)
    t0 = time.monotonic()
    for n in _ints(a.eval_steps):
        for who, provider, mcond in (("reference", None, {"kind": "scripted", "name": "reference solution"}),
                                     ("model", {"kind": "local", "ckpt": str(sft.resolve())}, cond)):
            print(f"== sustain: {who}, chains of {n} steps, seeds {seeds}, compaction on ({a.context_tokens}) "
                  "and off", flush=True)
            rows = run_sustain(provider, mcond, out / "eval" / f"{who}-{n}", steps=n, seeds=seeds,
                               context_tokens=a.context_tokens, effort="max", temperature=0.0,
                               max_tokens=a.max_tokens, workers=a.workers, log=lambda s: None)
            report[who][str(n)] = summarize(rows, n)
            for mode, s in report[who][str(n)].items():
                print(f"   {who:9} N={n:<4} compaction {mode:3}: score {s['score']}, sustained calls "
                      f"{s['sustained_calls']} of {s['calls']}, max context {s['max_sent_tokens']}", flush=True)
    times["eval_s"] = time.monotonic() - t0
    times["total_s"] = time.monotonic() - t_all
    report.update({
        **{k: v for k, v in trained.items() if k != "train_times"},
        "eval_steps": _ints(a.eval_steps), "eval_seeds": seeds, "effort": "max", "temperature": 0.0,
        "max_tokens": a.max_tokens, "model_condition": cond,
        "times": {**trained["train_times"], **{k: round(v, 1) for k, v in times.items()}}, "machine": machine(),
        "date": time.strftime("%Y-%m-%d")})
    (out / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    plot(report, out / "sustain.png")
    results = Path(a.results)
    results.parent.mkdir(parents=True, exist_ok=True)
    with open(results, "a") as f:
        for n, modes in report["model"].items():
            for mode, s in modes.items():
                f.write(json.dumps({"bench": "sustain", "steps": int(n), "compaction": mode,
                                    "context_tokens": a.context_tokens, "score": s["score"],
                                    "sustained_calls": s["sustained_calls"], "calls": s["calls"],
                                    "max_sent_tokens": s["max_sent_tokens"], "machine": report["machine"],
                                    "date": report["date"]}) + "\n")
    print(f"report: {out / 'report.json'}, plot: {out / 'sustain.png'}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
