"""Shared by the benchmarks: median wall time of repeated calls; appending result rows (SPEC §8 JSON lines)."""

import json
import statistics
import time


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


def append_results(path, rows) -> None:
    """Append each row as one JSON line to ``path`` (its folder is made when missing)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as fh:
        for r in rows:
            fh.write(json.dumps(r) + "\n")
