"""Ablations from the CLI at one fixed budget: every variant is `k3 train` with the same preset,
steps, batch, sequence length, data and seed; only the named switch differs.

    Per-Head Muon vs full-matrix Muon vs AdamW      (--optimizer per_head | muon | adamw)
    Block AttnRes vs standard residual              (--attn-res / --no-attn-res)
    SiTU vs SwiGLU                                  (--hidden-act situ | silu)
    Quantile Balancing vs DeepSeek-V3 sign update   (--balance quantile | sign; final load CV)

Reports final validation loss and bits per byte (whole validation split), the mean train loss of
the last 10% of steps and the final mean expert-load CV. The baseline of each group is its first
variant (the K3 recipe); ratio = variant / baseline. Runs go two at a time, one thread each.
Appends JSON lines to benchmarks/results/ablations.jsonl, stamped with the machine, date and commit
(``_timing.append_results``); each names its group, variant and settings.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from _timing import append_results  # benchmarks/ is on sys.path when run as a script

RESULTS = Path(__file__).parent / "results" / "ablations.jsonl"

GROUPS = {
    "optimizer": [("per_head", ["--optimizer", "per_head"]), ("muon", ["--optimizer", "muon"]),
                  ("adamw", ["--optimizer", "adamw"])],
    "residual": [("attn_res", ["--attn-res"]), ("standard", ["--no-attn-res"])],
    "activation": [("situ", ["--hidden-act", "situ"]), ("swiglu", ["--hidden-act", "silu"])],
    "balance": [("quantile", ["--balance", "quantile"]), ("sign", ["--balance", "sign"])],
}


def summarize(run_dir: Path) -> dict:
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    train = [r for r in recs if r["kind"] == "train"]
    val = [r for r in recs if r["kind"] == "val"]
    tail = train[-max(1, len(train) // 10):]
    cv = [r["load_cv"] for r in tail if r.get("load_cv") is not None]
    return {"val_loss": val[-1]["val_loss"], "val_bpb": val[-1]["val_bpb"],
            "train_loss_tail": sum(r["loss"] for r in tail) / len(tail),
            "load_cv": sum(cv) / len(cv) if cv else None, "steps": train[-1]["step"]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="nano")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--groups", default=",".join(GROUPS), help="comma-separated subset of " + ",".join(GROUPS))
    ap.add_argument("--parallel", type=int, default=2)
    a = ap.parse_args()
    groups = {g: GROUPS[g] for g in a.groups.split(",")}
    common = ["--preset", a.preset, "--steps", str(a.steps), "--seq-len", str(a.seq_len), "--batch-size",
              str(a.batch_size), "--lr", str(a.lr), "--threads", "1", "--no-plot", "--eval-interval", "0",
              "--ckpt-interval", "0", "--seed", "0"]
    with tempfile.TemporaryDirectory() as tmp:
        jobs = [(g, name, flags) for g, vs in groups.items() for name, flags in vs]
        procs: list[tuple[str, str, Path, subprocess.Popen]] = []
        results: dict[tuple[str, str], dict] = {}

        def reap(p):
            g, name, out, proc = p
            if proc.wait():
                raise SystemExit(f"{g}/{name} failed:\n{proc.stderr.read()}")
            results[(g, name)] = summarize(out)
            print(f"  done {g}/{name}: {results[(g, name)]}", flush=True)

        for g, name, flags in jobs:
            while len(procs) >= a.parallel:
                reap(procs.pop(0))
            out = Path(tmp) / f"{g}-{name}"
            cmd = [sys.executable, "-m", "k3.cli", "train", *common, "--out", str(out), *flags]
            procs.append((g, name, out, subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                                         text=True)))
        for p in procs:
            reap(p)

    config = f"{a.preset} steps={a.steps} T={a.seq_len} B={a.batch_size} lr={a.lr}"
    print(f"\nablations ({config}); ratio = variant / first variant of its group")
    print(f"{'group':<12}{'variant':<10}{'val loss':>10}{'val bpb':>9}{'ratio':>8}{'tail train':>12}{'load CV':>9}")
    settings = {"preset": a.preset, "steps": a.steps, "seq_len": a.seq_len, "batch_size": a.batch_size, "lr": a.lr}
    rows = []
    for g, vs in groups.items():
        base = results[(g, vs[0][0])]
        for name, _ in vs:
            r = results[(g, name)]
            metric = "load_cv" if g == "balance" else "val_bpb"
            ratio = (r[metric] / base[metric]) if base[metric] else None
            cv = f"{r['load_cv']:.3f}" if r["load_cv"] is not None else "-"
            print(f"{g:<12}{name:<10}{r['val_loss']:>10.4f}{r['val_bpb']:>9.4f}{ratio:>8.3f}"
                  f"{r['train_loss_tail']:>12.4f}{cv:>9}")
            rows.append({"bench": "ablations", "config": f"{config} {g}={name}", "metric": metric,
                         "value": r[metric], "baseline": base[metric], "ratio": ratio,
                         "val_loss": r["val_loss"], "val_bpb": r["val_bpb"], "load_cv": r["load_cv"],
                         "train_loss_tail": r["train_loss_tail"], "group": g, "variant": name,
                         "settings": settings})
    append_results(RESULTS, rows)


if __name__ == "__main__":
    main()
