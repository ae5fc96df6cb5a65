"""benchmarks/sustain.py end to end at nano size: per-turn SFT rows of short chains under compaction,
SFT from a nano base, then sustain episodes of the SFT model and of the reference solution with
compaction on and off; the reference (the positive control) scores 1 in both modes and is sent at
most the limit with compaction on, and the report, plot, results line and docs table are written.
``sustained`` is checked against curves written by hand."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from k3.tasks.families import get_family

ROOT = Path(__file__).resolve().parents[2]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "benchmarks" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_sustained_is_where_progress_last_rose():
    S = _load("sustain")
    assert S.sustained([[1, 9, 0.0], [2, 9, 0.25], [3, 9, 0.25], [4, 9, 0.5], [5, 9, 0.5]]) == 4
    assert S.sustained([[1, 9, 0.0], [2, 9, 0.0]]) == 0
    assert S.sustained([]) == 0


@pytest.mark.slow
def test_the_sustain_benchmark_at_nano_size(tmp_path, make_nano_checkpoint, env_root):
    text = " ".join(json.dumps(get_family("chain3").solve(get_family("chain3").spec(s), "max")) for s in range(4))
    base, _, _ = make_nano_checkpoint(tmp_path / "base", text)
    out = tmp_path / "run"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "sustain.py"), "--out", str(out), "--base", str(base),
           "--train-steps", "3", "--train-seeds", "2", "--context-tokens", "400", "--sft-steps", "2",
           "--batch-size", "2", "--seq-len", "2048", "--eval-steps", "4", "--eval-seeds", "1", "--max-tokens", "8",
           "--results", str(tmp_path / "results.jsonl")]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    report = json.loads((out / "report.json").read_text())
    assert report["synth"] == {"chain3": {"episodes": 2, "rows": 2 * 8, "failed": 0}}  # 8 turns per episode
    ref = report["reference"]["4"]
    assert ref["on"]["score"] == ref["off"]["score"] == [1.0]
    assert max(ref["on"]["max_sent_tokens"]) <= 400 < max(ref["off"]["max_sent_tokens"])
    assert ref["on"]["sustained_calls"] == [8]  # the last of the 4 writes is call 8
    model = report["model"]["4"]
    assert set(model) == {"on", "off"} and all(len(m["score"]) == 1 for m in model.values())
    assert report["model_condition"]["kind"] == "checkpoint" and report["machine"] and report["date"]
    assert (out / "sustain.png").stat().st_size > 0
    lines = [json.loads(x) for x in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert [(x["steps"], x["compaction"]) for x in lines] == [(4, "on"), (4, "off")]
    table = _load("docs_tables").sustain_table(report)
    assert "| 4 | on |" in table and "| 4 | off |" in table and report["date"] in table
    # --reuse evaluates the trained model again (here at another length) with the same training record
    r = subprocess.run(cmd[:cmd.index("--eval-steps")] + ["--eval-steps", "2", "--eval-seeds", "1", "--max-tokens",
                                                         "8", "--results", str(tmp_path / "results.jsonl"),
                                                         "--reuse"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    again = json.loads((out / "report.json").read_text())
    assert again["sft"] == report["sft"] and again["synth"] == report["synth"] and set(again["model"]) == {"2"}
    assert "SFT:" not in r.stdout and again["model_condition"] == report["model_condition"]
    bad = cmd[:cmd.index("--context-tokens")] + ["--context-tokens", "300", "--reuse"]
    r = subprocess.run(bad, capture_output=True, text=True, timeout=600)
    assert r.returncode == 1 and "is not the limit" in r.stderr
