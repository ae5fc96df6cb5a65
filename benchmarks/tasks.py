"""The starter suite with the Scripted provider (issue 14 "Speed and scale"; SPEC §8 JSON lines).

Runs every reference solution and every hack of ``tasks/`` (``k3.rl.rollout.run_jobs``, the same
function ``k3 task suite`` runs) in real sandboxes (``--backend``, namespace by default) with 1
worker (in process), ``--workers`` workers (a process pool) and, unless ``--no-ray``, Ray tasks on
a local instance of ``--workers`` CPUs. Prints the wall time of each, the Ray start-up separately
(``ray.init`` is timed on its own, then the same jobs run on the started instance), and the
per-rollout overhead from the 1-worker run's trajectories, broken down (median and total
seconds): agent sandbox create + workspace copy, agent loop (the scripted tool calls), agent
sandbox close, submission collection, and per verification: create, copy in, run of verify.py,
close. Every rollout must score its transcript's ``expect_reward`` (exit 1 otherwise).

``python benchmarks/tasks.py [--tasks tasks] [--workers 2] [--backend namespace] [--no-ray]``;
appends JSON lines to ``benchmarks/results/tasks.jsonl``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

from k3.rl.rollout import run_jobs
from k3.tasks.format import find_tasks, validate_task
from k3.tasks.verify import Sandboxes

PARTS = ["agent_sandbox", "agent", "agent_close", "collect", "verify.create", "verify.copy", "verify.run",
         "verify.close"]


def jobs_for(root: Path, backend: str) -> list[dict]:
    jobs = []
    for d in find_tasks(root):
        t = validate_task(d)
        for label, tr in [("solution", t.solution)] + [(f"hack:{h.path.stem}", h) for h in t.hacks]:
            jobs.append({"task": str(t.root), "provider": {"kind": "scripted", "transcript": str(tr.path)},
                         "label": label, "expect": tr.expect_reward, "backend": backend})
    return jobs


def timed(jobs, **kw) -> tuple[float, list[dict]]:
    t0 = time.perf_counter()
    res = run_jobs(jobs, **kw)
    return time.perf_counter() - t0, res


def breakdown(results: list[dict]) -> dict:
    rows: dict[str, list[float]] = {p: [] for p in PARTS}
    for r in results:
        t = r["timings"]
        for p in PARTS[:4]:
            rows[p].append(t.get(p, 0.0))
        for k in ("create", "copy", "run", "close"):
            rows[f"verify.{k}"].append(t.get("verify_parts", {}).get(k, 0.0))
    return {p: {"median": statistics.median(v), "total": sum(v)} for p, v in rows.items() if v}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tasks", default=str(Path(__file__).resolve().parents[1] / "tasks"))
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--backend", default="namespace")
    ap.add_argument("--no-ray", action="store_true")
    args = ap.parse_args(argv)
    jobs = jobs_for(Path(args.tasks), args.backend)
    Sandboxes(args.backend)  # the base image is built before any timing
    n_tasks = len({j["task"] for j in jobs})
    out = {"bench": "tasks", "tasks": n_tasks, "rollouts": len(jobs), "backend": args.backend,
           "cpus": os.cpu_count(), "load_avg_1m": os.getloadavg()[0]}
    wall1, res1 = timed(jobs, workers=1)
    walln, resn = timed(jobs, workers=args.workers)
    out |= {"wall_1_worker": wall1, f"wall_{args.workers}_workers": walln}
    runs = [res1, resn]
    if not args.no_ray:
        import ray

        t0 = time.perf_counter()
        ray.init(num_cpus=args.workers, include_dashboard=False, log_to_driver=False)
        out["ray_init"] = time.perf_counter() - t0
        try:
            out[f"wall_ray_{args.workers}_cpus"], res_ray = timed(jobs, workers=args.workers, use_ray=True)
        finally:
            ray.shutdown()
        runs.append(res_ray)
    bad = [f"{r['task']} {r['label']}: {r['score']} != {r['expect']} ({r['status']})"
           for res in runs for r in res if r["score"] != r["expect"] or r["status"] == "error"]
    out["per_rollout"] = breakdown(res1)
    out["mismatches"] = len(bad)
    print(f"{n_tasks} tasks, {len(jobs)} rollouts (solutions + hacks), backend {args.backend}, "
          f"load avg {out['load_avg_1m']:.1f} on {out['cpus']} cpus")
    for k in ("wall_1_worker", f"wall_{args.workers}_workers", "ray_init", f"wall_ray_{args.workers}_cpus"):
        if k in out:
            print(f"  {k:24} {out[k]:8.2f} s" + (f"   ({out[k] / len(jobs):.2f} s per rollout)"
                                                 if k != "ray_init" else ""))
    print("  per rollout (1 worker)    median s   total s")
    for p, v in out["per_rollout"].items():
        print(f"    {p:22} {v['median']:9.3f} {v['total']:9.2f}")
    for b in bad:
        print("MISMATCH", b)
    res_dir = Path(__file__).resolve().parent / "results"
    res_dir.mkdir(exist_ok=True)
    with open(res_dir / "tasks.jsonl", "a") as f:
        f.write(json.dumps({**out, "time": time.time()}) + "\n")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
