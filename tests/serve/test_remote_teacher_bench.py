"""benchmarks/remote_teacher.py end to end at nano size: ``k3 serve`` scores rows of 257 ids (one
past its prefix-cache block, the chunking that once failed), through ``RemoteTeacher`` at 1 and 2
requests in flight; the two levels give the same logprobs and a results line each."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_benchmark_scores_rows_at_each_level(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location("bench_remote_teacher", ROOT / "benchmarks" / "remote_teacher.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path / "rt.jsonl"
    monkeypatch.delenv("K3_RESULTS_DIR", raising=False)
    assert mod.main(["--rows", "3", "--tokens", "256", "--concurrency", "2", "--repeats", "1", "--threads", "1",
                     "--results", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["concurrency"] for r in rows] == [1, 2]
    assert all(r["value"] > 0 and r["max_abs_diff_vs_1"] <= 1e-4 and r["machine"] and r["date"] for r in rows)
    assert rows[0]["ratio"] == 1.0 and rows[1]["baseline"] == rows[0]["value"]
