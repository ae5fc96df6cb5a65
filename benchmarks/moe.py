"""LatentMoE dispatch benchmark (SPEC §8): sort + grouped_mm and the capacity path against a
per-expert Python loop that indexes the stacked weights (the baseline the style guide warns about).

    .venv/bin/python benchmarks/moe.py [--preset small] [--tokens 2048] [--repeats 5]

Forward + backward time per step, medians; prints a table and appends JSON lines to
benchmarks/results/moe.jsonl (stamped with the machine, date and commit by ``_timing.append_results``).
Ratios only; every side is measured in this process.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from _timing import append_results  # benchmarks/ is on sys.path when run as a script

from k3.config import get_preset
from k3.model.moe import LatentMoE

RESULTS = Path(__file__).parent / "results" / "moe.jsonl"


def loop_dispatch(m: LatentMoE, z: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """Baseline: for each expert, gather its tokens and apply w[e] (indexing the stacked weights)."""
    u = torch.zeros(z.shape[0], z.shape[1], dtype=torch.float32)
    ex = m.experts
    for e in range(m.num_experts):
        tok, slot = (indices == e).nonzero(as_tuple=True)
        if tok.numel() == 0:
            continue
        h = ex.act(z[tok] @ ex.w1[e].T, z[tok] @ ex.w3[e].T) @ ex.w2[e].T
        u = u.index_add(0, tok, h.float() * weights[tok, slot, None])
    return u


def step_time(m: LatentMoE, x: torch.Tensor, repeats: int) -> float:
    def run():
        m.zero_grad(set_to_none=True)
        m(x).square().mean().backward()
    run()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="small")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.set_flush_denormal(True)
    torch.manual_seed(0)
    cfg = get_preset(args.preset)
    m = LatentMoE(cfg)
    x = torch.randn(args.tokens, cfg.hidden_size)
    baseline = step_time(_with_dispatch(m, "loop"), x, args.repeats)
    rows = []
    print(f"{'config':<40} {'metric':<16} {'value':>10} {'baseline':>10} {'ratio':>8}")
    for name, cap in (("sorted grouped_mm", None), ("capacity 1.25", 1.25)):
        m.capacity_factor = cap
        t = step_time(_with_dispatch(m, "native"), x, args.repeats)
        row = dict(bench="moe", config=f"{args.preset} N={args.tokens} t={torch.get_num_threads()} {name}", metric="fwd_bwd_s",
                   value=t, baseline=baseline, ratio=baseline / t, baseline_name="per-expert loop",
                   preset=args.preset, tokens=args.tokens, threads=torch.get_num_threads(), dispatch=name,
                   repeats=args.repeats)
        rows.append(row)
        print(f"{row['config']:<40} {row['metric']:<16} {t:>10.4f} {baseline:>10.4f} {row['ratio']:>7.2f}x")
    append_results(RESULTS, rows)


def _with_dispatch(m: LatentMoE, kind: str) -> LatentMoE:
    """Switch the dropless dispatch between the module's own and the loop baseline."""
    if kind == "loop":
        m._dispatch_sorted = lambda z, w, i: loop_dispatch(m, z, w, i)
        m.capacity_factor = None
    else:
        m.__dict__.pop("_dispatch_sorted", None)
    return m


if __name__ == "__main__":
    main()
