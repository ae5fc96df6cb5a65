"""Shared by the benchmarks: median wall time of repeated calls; appending result rows (SPEC §8 JSON
lines), each stamped with the machine, the date and the commit it was measured on."""

import json
import os
import statistics
import subprocess
import time
from pathlib import Path


def median_time(fn, repeats: int, warmup: int = 1) -> float:
    """Median seconds of ``repeats`` calls of ``fn`` after ``warmup`` untimed calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _commit() -> str | None:
    """The checkout's commit (with ``+dirty`` when files differ from it), None outside git."""
    repo = Path(__file__).resolve().parents[1]
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=repo, capture_output=True, text=True,
                             timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=repo,
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return (sha + ("+dirty" if dirty else "")) or None


def stamp(row: dict, common: dict | None = None) -> dict:
    """``row`` with ``machine`` (CPU model and cores), ``date`` and ``commit`` added where missing
    (``common``: those three, computed once for many rows by ``measured_on``)."""
    common = measured_on() if common is None else common
    return {**row, **{k: v for k, v in common.items() if not row.get(k)}}


def measured_on() -> dict:
    """The machine, date and commit of this run, and ``run``: one id shared by the rows written
    together (the time and the process id; ``benchmarks/docs_tables.py`` takes a file's last run by it)."""
    from k3.rl.eval_rows import machine

    return {"machine": machine(), "date": time.strftime("%Y-%m-%d"), "commit": _commit(),
            "run": f"{time.strftime('%Y-%m-%dT%H:%M:%S')}-{os.getpid()}"}


def append_results(path, rows) -> Path:
    """Append each row, stamped (``stamp``), as one JSON line to ``path`` (its folder is made when missing);
    with ``K3_RESULTS_DIR`` set, to the file of that name in that folder instead (``refresh_docs.sh --quick``
    keeps a pipeline check's rows out of benchmarks/results). Returns the file written."""
    path = Path(path)
    if os.environ.get("K3_RESULTS_DIR"):
        path = Path(os.environ["K3_RESULTS_DIR"]) / path.name
    common = measured_on()
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as fh:
        for r in rows:
            fh.write(json.dumps(stamp(r, common)) + "\n")
    return path
