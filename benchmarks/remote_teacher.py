"""A remote teacher's scoring rate (``k3 distill``, docs/DISTILL.md): rows scored per second by
``RemoteTeacher.token_logprobs`` against ``k3 serve`` at 1 request in flight (the baseline) and at
``--concurrency`` levels, measured in the same run against the same server.

A random-weight ``--preset`` model and a small tokenizer (``serve_load.build_checkpoint``) are
served by ``k3 serve`` on a free loopback port, stopped at the end. A micro-batch of ``--rows``
rows of ``--tokens`` random token ids, every position a target, is scored ``--repeats`` times at
each level (median wall time). Each level's logprobs are compared with the baseline's (the
server batches concurrent requests; its answers must not depend on it beyond float rounding).

``python benchmarks/remote_teacher.py [--preset nano] [--rows 16] [--tokens 256] [--concurrency 2,4,8]
[--threads 2] [--repeats 3]``; prints a table, appends JSON lines to ``benchmarks/results/remote_teacher.jsonl``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from _timing import append_results, median_time  # noqa: E402
from serve_load import build_checkpoint  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="nano")
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--concurrency", default="2,4,8")
    p.add_argument("--threads", type=int, default=2, help="OMP_NUM_THREADS of the server")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--results", default=str(Path(__file__).parent / "results" / "remote_teacher.jsonl"))
    a = p.parse_args(argv)
    try:
        levels = [int(c) for c in a.concurrency.split(",")]
    except ValueError:
        p.error(f"--concurrency must be ints, got {a.concurrency!r}")
    if a.rows < 1 or a.tokens < 2 or any(c < 1 for c in levels):
        p.error("--rows, --concurrency must be >= 1 and --tokens >= 2")

    from k3.data.tokenizer import Tokenizer
    from k3.rl.distill import RemoteTeacher
    from k3.serve.launch import launch

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Path(tmp) / a.preset
        model = build_checkpoint(a.preset, ckpt)
        tok = Tokenizer.load(ckpt / "tokenizer.json")
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, tok.vocab_size, (a.rows, a.tokens + 1), generator=g)
        x, y = ids[:, :-1], ids[:, 1:]
        with launch(ckpt, "--max-batch", str(max([1] + levels)), threads=a.threads) as srv:
            spec = {"url": srv.url + "/v1", "model": model, "timeout": 120.0}
            base = None
            for c in [1] + levels:
                teacher = RemoteTeacher("general/high", {**spec, "concurrency": c}, tok)
                got = teacher.token_logprobs(x, y)        # also the warm-up call
                secs = median_time(lambda: teacher.token_logprobs(x, y), a.repeats, warmup=0)
                if base is None:
                    base, ref = secs, got
                diff = float((got - ref).abs().max())
                rows.append({"bench": "remote_teacher", "config": f"{a.preset}, server {a.threads} threads",
                             "metric": f"rows_per_s_concurrency_{c}", "value": a.rows / secs,
                             "baseline": a.rows / base, "ratio": base / secs, "rows": a.rows, "tokens": a.tokens,
                             "concurrency": c, "max_abs_diff_vs_1": diff})
                print(f"concurrency {c:3d}: {a.rows / secs:8.2f} rows/s  ×{base / secs:5.2f} vs 1 in flight  "
                      f"max |Δ logprob| vs 1: {diff:.1e}", flush=True)
    print(f"results: {append_results(a.results, rows)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
