"""Sandbox latency and snapshot storage (namespace backend; issue targets: fork <= 200 ms, exec
round trip of `true` <= 20 ms; snapshots grow the store by the changed files only).

Measured in one process, medians of repeated runs, on a workspace of ``--workspace-mb`` MB of
random files (1 MB each):

* create  -- a new sandbox with that workspace: the first one commits the workspace to the store
  (hash + copy), later ones find every file stored (baseline: the same with an empty workspace)
* exec    -- the round trip of ``true`` through the exec agent (baseline: ``subprocess.run(["true"])``
  on the host, the floor of starting any process)
* snapshot / fork -- after changing ``--changed-kb`` KB in one file (baseline: the issue's target)
* storage -- bytes the store grew by per snapshot / bytes changed (1.0 = only the changed files)

Section ``vm`` (``--vm-repeats``, 0 skips it): the QEMU microvm backend on its own busybox guest --
create (a boot), exec round trip of ``true``, snapshot (stop + migrate the whole machine to a
file + store it), fork and restore (a QEMU loading that file), and the state file's size (baseline:
the VM's RAM size, i.e. what a dump without zero-page elision would write).

Appends JSON lines ``{"bench", "config", "metric", "value", "baseline", "ratio", ...}`` to
benchmarks/results/env.jsonl. ``--root`` keeps the manager root (default: a fresh temp dir).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from _timing import append_results, median_time  # benchmarks/ is on sys.path when run as a script

from k3.env import Limits, SandboxManager

RESULTS = Path(__file__).parent / "results" / "env.jsonl"


def _row(config: dict, metric: str, value: float, base: float, name: str) -> dict:
    return {"bench": "env", "config": config, "metric": metric, "value": round(value, 5),
            "baseline": round(base, 5), "baseline_name": name, "ratio": round(value / base, 3)}


def _report(rows: list[dict], width: int) -> None:
    """Print the rows as a table (value columns ``width`` wide) and append them to RESULTS."""
    print(f"{'metric':<34}{'value':>{width}}{'baseline':>{width}}{'ratio':>8}  baseline is")
    for r in rows:
        print(f"{r['metric']:<34}{r['value']:>{width}}{r['baseline']:>{width}}{r['ratio']:>8}  {r['baseline_name']}")
    append_results(RESULTS, rows)


def _timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workspace-mb", type=int, default=100)
    ap.add_argument("--changed-kb", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--exec-repeats", type=int, default=50)
    ap.add_argument("--root")
    ap.add_argument("--vm-repeats", type=int, default=3)
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="k3bench-env-")
    root = args.root or os.path.join(tmp, "root")
    mgr = SandboxManager(root)
    mgr.resolve_image("default")  # build the image outside the timings
    ws, empty = os.path.join(tmp, "ws"), os.path.join(tmp, "empty")
    os.makedirs(ws)
    os.makedirs(empty)
    for i in range(args.workspace_mb):
        with open(os.path.join(ws, f"f{i:04d}.bin"), "wb") as f:
            f.write(os.urandom(1 << 20))
    rows, sandboxes = [], []
    try:
        def create(src):
            sb = mgr.create(workspace=src, limits=Limits())
            sandboxes.append(sb)
            return sb

        t_creates = [_timed(lambda: create(ws))[0] for _ in range(args.repeats)]
        t_create_first, t_create = t_creates[0], statistics.median(t_creates[1:] or t_creates)
        t_create_empty = statistics.median(_timed(lambda: create(empty))[0] for _ in range(args.repeats))
        sb = sandboxes[0]
        t_exec = median_time(lambda: sb.exec(["true"]), args.exec_repeats, warmup=3)
        t_host = median_time(lambda: subprocess.run(["true"]), args.exec_repeats, warmup=3)
        snaps, growth = [], []
        t_snap, first = [], None
        for i in range(args.repeats):
            payload = os.urandom(args.changed_kb << 10)  # new content each time: the store must grow
            first = first or payload
            sb.write_file(f"changed{i}.bin", payload)
            before = mgr.store.usage()
            dt, sid = _timed(sb.snapshot)
            t_snap.append(dt)
            snaps.append(sid)
            growth.append((mgr.store.usage() - before) / len(payload))
        t_fork = []
        for _ in range(args.repeats):
            dt, f = _timed(lambda: mgr.fork(snaps[-1]))
            sandboxes.append(f)
            t_fork.append(dt)
        assert sandboxes[-1].exec(["cat", "changed0.bin"]).stdout == first
    finally:
        for s in sandboxes:
            s.close()
        if not args.root:
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            shutil.rmtree(ws, ignore_errors=True)
    config = {"backend": "namespace", "workspace_mb": args.workspace_mb, "changed_kb": args.changed_kb,
              "cpus": os.cpu_count(), "load1": round(os.getloadavg()[0], 2)}
    t_snap_m, t_fork_m = statistics.median(t_snap), statistics.median(t_fork)
    g = statistics.median(growth)
    for metric, value, base, name in (
            ("create_first_s", t_create_first, t_create_empty, "create with an empty workspace"),
            ("create_again_s", t_create, t_create_empty, "create with an empty workspace"),
            ("exec_true_s", t_exec, t_host, "host subprocess.run(['true'])"),
            ("exec_true_vs_target", t_exec, 0.020, "target 20 ms"),
            ("snapshot_s", t_snap_m, 0.200, "200 ms (fork target, for scale)"),
            ("fork_s", t_fork_m, 0.200, "target 200 ms"),
            ("snapshot_growth_per_changed_byte", g, 1.0, "changed bytes only")):
        rows.append(_row(config, metric, value, base, name))
    print(f"k3.env namespace backend, {args.workspace_mb} MB workspace, {args.changed_kb} KB changed per snapshot, "
          f"median of {args.repeats} ({args.exec_repeats} for exec); load {config['load1']} on {config['cpus']} CPUs")
    _report(rows, 12)
    if args.vm_repeats > 0:
        bench_vm(args.vm_repeats)


def bench_vm(repeats: int) -> None:
    """The ``vm`` section (see the module docstring); medians of ``repeats`` runs."""
    tmp = tempfile.mkdtemp(prefix="k3bench-vm-")
    mgr = SandboxManager(os.path.join(tmp, "root"))
    mgr.resolve_image("default")
    sbs = []
    try:
        t_create, sb = _timed(lambda: mgr.create(backend="vm"))
        sbs.append(sb)
        sb.exec("i=0; while :; do i=$((i+1)); sleep 1; done > /dev/null 2>&1 &")  # a live process
        t_exec = median_time(lambda: sb.exec(["true"]), 5 * repeats, warmup=2)
        t_host = median_time(lambda: subprocess.run(["true"]), 5 * repeats, warmup=2)
        infos = [_timed(sb.snapshot_info) for _ in range(repeats)]
        t_snap = statistics.median(dt for dt, _ in infos)
        size = statistics.median(i.meta["state_bytes"] for _, i in infos)
        t_fork = []
        for _ in range(repeats):
            dt, f = _timed(lambda: mgr.fork(infos[-1][1].id))
            sbs.append(f)
            t_fork.append(dt)
        t_restore = statistics.median(_timed(lambda: sb.restore(infos[0][1].id))[0] for _ in range(repeats))
        ram = sb.config.mem_mb * 2**20
        accel = sb.config.accel
    finally:
        for s in sbs:
            s.close()
        shutil.rmtree(tmp, ignore_errors=True)
    config = {"backend": "vm", "accel": accel, "guest_ram_mb": ram >> 20, "cpus": os.cpu_count(),
              "load1": round(os.getloadavg()[0], 2)}
    rows = []
    for metric, value, base, name in (
            ("create_boot_s", t_create, 0.200, "200 ms (fork target, for scale)"),
            ("exec_true_s", t_exec, t_host, "host subprocess.run(['true'])"),
            ("snapshot_s", t_snap, 0.200, "200 ms (fork target, for scale)"),
            ("fork_s", t_fork and statistics.median(t_fork), 0.200, "target 200 ms"),
            ("restore_s", t_restore, 0.200, "200 ms (fork target, for scale)"),
            ("state_bytes", size, ram, "guest RAM size")):
        rows.append(_row(config, metric, value, base, name))
    print(f"\nk3.env vm backend ({accel}, {ram >> 20} MiB guest), median of {repeats} "
          f"({5 * repeats} for exec); load {config['load1']} on {config['cpus']} CPUs")
    _report(rows, 14)


if __name__ == "__main__":
    main()
