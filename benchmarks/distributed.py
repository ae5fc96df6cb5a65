"""Distributed training benchmark (SPEC §8): tokens/s at 1 and 2 processes, all-to-all bytes per
step measured against ``k3 plan``'s formula, and the fraction of step time spent in communication.

    .venv/bin/python benchmarks/distributed.py [--preset nano] [--steps 12] [--nprocs 1,2]

Each process count runs the ``Trainer`` (with its ``Distributed`` parallelism) under ``torchrun
--standalone`` (gloo on CPU, NCCL with ``--device cuda``) on the same global batch, with ep = the
process count (so 2 processes exchange tokens by all-to-all) and capacity factor 1.25. Per timed
step (the first ``--warmup`` excluded):

- tokens/s: global tokens / step wall time (median); ratio = tokens/s at N over tokens/s at 1.
- all-to-all bytes: what the dispatcher sent to other ranks (``CommStats``), per rank and step,
  against ``k3.train.plan.all_to_all_capacity_bytes_per_step`` (ratio 1.0 = the formula is exact).
- communication fraction: torch.profiler CPU time of the collectives (c10d / gloo / nccl events:
  FSDP all-gathers and reduce-scatters, all-reduces, all-to-alls) over the profiled steps' wall
  time, measured on rank 0.

On this machine (2 shared CPU cores) two processes share the cores the single process had to
itself, so tokens/s at 2 measures overhead, not speed-up. Appends JSON lines to
benchmarks/results/distributed.jsonl.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results" / "distributed.jsonl"
_COMM = ("c10d", "gloo", "nccl", "all_gather", "reduce_scatter", "all_reduce", "allreduce",
         "all_to_all", "alltoall", "allgather", "broadcast", "barrier")


def _corpus(root: Path) -> Path:
    """A few stdlib modules (~100 KB of Python), the same kind of text the tests train on."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    root.mkdir(parents=True, exist_ok=True)
    for name in ("json/decoder.py", "json/encoder.py", "textwrap.py", "csv.py", "bisect.py",
                 "heapq.py", "colorsys.py", "fnmatch.py", "json/__init__.py", "json/scanner.py"):
        shutil.copy(stdlib / name, root / name.replace("/", "_"))
    return root


def worker(args) -> None:
    """One rank: train, time steps, count all-to-all bytes, profile collectives; rank 0 writes JSON."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from k3.train.config import TrainConfig
    from k3.train.distributed import destroy
    from k3.train.loop import Trainer

    world = int(os.environ["WORLD_SIZE"])
    tc = TrainConfig.build(overrides=dict(
        preset=args.preset, data=args.data, out=args.run_dir, steps=args.steps, batch_size=args.batch_size,
        curriculum=[[0, args.seq_len]], ep=world, capacity_factor=1.25, threads=1, eval_interval=0,
        eval_batches=1, final_eval_batches=1, ckpt_interval=0, log_interval=10**6, plot=False,
        device=args.device))
    tr = Trainer(tc, print_fn=lambda *a: None, tty=False, overwrite=True)
    times, a2a = [], []
    prof_wall, prof_comm = 0.0, 0.0
    for s in range(args.steps):
        tr.parallel.comm.reset()
        profiled = s >= args.steps - args.profile_steps
        t0 = time.perf_counter()
        if profiled:
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                tr.train_step()
            wall = time.perf_counter() - t0
            prof_wall += wall
            prof_comm += sum(e.self_cpu_time_total for e in prof.key_averages()
                             if any(c in e.key.lower() for c in _COMM)) / 1e6
        else:
            tr.train_step()
            wall = time.perf_counter() - t0
        if s >= args.warmup and not profiled:
            times.append(wall)
            a2a.append(tr.parallel.comm.bytes)
    tr.close()
    if tr.rank == 0:
        tokens = tc.batch_size * args.seq_len
        Path(args.json).write_text(json.dumps({
            "world": world, "tokens_per_s": tokens / statistics.median(times),
            "a2a_bytes_per_step": statistics.median(a2a) if a2a else 0,
            "comm_fraction": prof_comm / prof_wall if prof_wall else float("nan"),
            "tokens_per_rank": tokens // world, "torch_threads": torch.get_num_threads()}))
    destroy()


def run_n(n: int, args, tmp: Path) -> dict:
    out = tmp / f"w{n}.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}",
           __file__, "--worker", "--json", str(out), "--run-dir", str(tmp / f"run{n}"), "--data", args.data,
           "--preset", args.preset, "--steps", str(args.steps), "--warmup", str(args.warmup),
           "--profile-steps", str(args.profile_steps), "--batch-size", str(args.batch_size),
           "--seq-len", str(args.seq_len), "--device", args.device]
    subprocess.run(cmd, check=True, timeout=1800, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return json.loads(out.read_text())


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="nano")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--profile-steps", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--nprocs", default="1,2")
    p.add_argument("--device", default="cpu")
    p.add_argument("--data")
    p.add_argument("--worker", action="store_true")
    p.add_argument("--json")
    p.add_argument("--run-dir")
    args = p.parse_args()
    if args.worker:
        return worker(args)

    import torch

    from k3.config import get_preset
    from k3.train.plan import all_to_all_capacity_bytes_per_step
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        os.environ.setdefault("K3_CACHE_DIR", str(tmp / "cache"))
        args.data = args.data or str(_corpus(tmp / "data"))
        res = {n: run_n(n, args, tmp) for n in map(int, args.nprocs.split(","))}
    cfg = get_preset(args.preset)
    base = res[min(res)]["tokens_per_s"]
    name = f"{args.preset} B={args.batch_size} T={args.seq_len} cf=1.25 {args.device}"
    print(f"{'procs':>5} {'ep':>3} {'tokens/s':>10} {'x 1 proc':>8} {'a2a B/step/rank':>16} "
          f"{'plan formula':>13} {'comm %':>7}")
    lines = []
    for n, r in sorted(res.items()):
        plan = all_to_all_capacity_bytes_per_step(cfg, r["tokens_per_rank"], n, torch.float32, 1.25)
        print(f"{n:>5} {n:>3} {r['tokens_per_s']:>10,.0f} {r['tokens_per_s'] / base:>8.2f} "
              f"{r['a2a_bytes_per_step']:>16,.0f} {plan:>13,} {100 * r['comm_fraction']:>6.1f}%")
        cfgn = f"{name} nproc={n} ep={n}"
        lines += [
            {"bench": "distributed", "config": cfgn, "metric": "tokens_per_s",
             "value": r["tokens_per_s"], "baseline": base, "ratio": r["tokens_per_s"] / base},
            {"bench": "distributed", "config": cfgn, "metric": "all_to_all_bytes_per_step_per_rank",
             "value": r["a2a_bytes_per_step"], "baseline": plan,
             "ratio": r["a2a_bytes_per_step"] / plan if plan else None},
            {"bench": "distributed", "config": cfgn, "metric": "comm_fraction_of_step",
             "value": r["comm_fraction"], "baseline": None, "ratio": None}]
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    with open(RESULTS, "a") as f:
        for line in lines:
            print(json.dumps(line))
            f.write(json.dumps(line) + "\n")


if __name__ == "__main__":
    main()
