"""The decode step's packed matmul (``k3.ops.packed_mm``) against torch's ``mm`` (MKL) on the same
products, in one run (SPEC §8 JSON lines).

For each weight shape of ``small``'s decode step and M = 1, 8, 16 rows: ``PackedMatrix.mm`` and
``torch.mm`` over the same ``x`` and weights, timed in turn, medians. A set of ``--copies`` weights
of each shape is cycled so that the weights come from memory, as in a step. Each row prints
GFLOP/s and GB/s (weight bytes read per second) of both and the ratio packed / torch; a large
M = 8 product, the ``tile()`` loop's compute rate, reads ~190 GFLOP/s on this machine's 2 cores.

``python benchmarks/packed_mm.py [--threads 2] [--copies 16] [--repeats 7]``
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from _timing import append_results  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "packed_mm.jsonl"
SHAPES = ((512, 2120), (512, 512), (256, 512), (512, 8192))   # KDA w_in, w_o; a latent expert; the lm head


def time_both(packed, dense, x, repeats: int) -> tuple[float, float]:
    """Median seconds per product of the packed kernel and of torch.mm, cycling the copies."""
    times = {"packed": [], "torch": []}
    for _ in range(repeats):
        for name, run in (("packed", lambda i: packed[i].mm(x)), ("torch", lambda i: torch.mm(x, dense[i]))):
            t0 = time.perf_counter()
            for i in range(len(packed)):
                run(i)
            times[name].append((time.perf_counter() - t0) / len(packed))
    return statistics.median(times["packed"]), statistics.median(times["torch"])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--copies", type=int, default=16, help="weights of each shape, cycled")
    ap.add_argument("--repeats", type=int, default=7)
    a = ap.parse_args(argv)
    for name, v in (("--threads", a.threads), ("--copies", a.copies), ("--repeats", a.repeats)):
        if v < 1:
            ap.error(f"{name} must be >= 1, got {v}")
    torch.set_num_threads(a.threads)
    from k3.ops.packed_mm import PackedMatrix

    torch.manual_seed(0)
    rows = []
    print(f"packed_mm vs torch.mm, {a.threads} threads, {a.copies} weight copies cycled (medians of {a.repeats})")
    print(f"{'shape':>18} {'M':>3} {'packed ms':>10} {'torch ms':>9} {'packed GFLOP/s':>15} {'packed GB/s':>12} "
          f"{'ratio':>6}")
    with torch.no_grad():
        for K, N in SHAPES:
            dense = [torch.randn(K, N) for _ in range(a.copies)]
            packed = [PackedMatrix(w) for w in dense]
            for M in (1, 8, 16):
                x = torch.randn(M, K)
                assert torch.allclose(packed[0].mm(x), x @ dense[0], rtol=1e-4, atol=1e-4)
                time_both(packed, dense, x, 1)
                tp, tt = time_both(packed, dense, x, a.repeats)
                gf, gb = 2 * M * K * N / tp / 1e9, K * N * 4 / tp / 1e9
                print(f"{f'[{M},{K}]@[{K},{N}]':>18} {M:>3} {tp * 1e3:>10.3f} {tt * 1e3:>9.3f} {gf:>15.1f} {gb:>12.1f} "
                      f"{tt / tp:>6.2f}")
                rows.append({"bench": "packed_mm", "K": K, "N": N, "M": M, "threads": a.threads,
                             "packed_s": tp, "torch_s": tt, "packed_gflops": gf, "packed_gbs": gb,
                             "ratio_vs_torch": tt / tp})
    append_results(RESULTS, rows)
    print(f"appended {len(rows)} rows to {RESULTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
