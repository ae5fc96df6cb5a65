"""`k3 demo`'s own code path (whole-split evaluation, gzip comparison, samples, plot), run on the
nano preset and a small local corpus instead of tiny on the whole stdlib."""

from __future__ import annotations

import json

import pytest
from test_loop import make_corpus  # same folder (pytest's default rootdir-relative import)

from k3.train import commands
from k3.train.rundir import MARKER_NAME


@pytest.mark.slow
def test_demo_reports_whole_split_bpb_next_to_gzip_and_samples(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("K3_CACHE_DIR", str(tmp_path / "cache"))
    data = make_corpus(tmp_path / "data")
    monkeypatch.setattr(commands, "DEMO_CONFIG", {
        **commands.DEMO_CONFIG, "preset": "nano", "data": str(data), "curriculum": [[0, 64]], "batch_size": 4,
        "eval_interval": 2, "eval_batches": 1, "final_eval_batches": 1, "ckpt_interval": 0})
    out = tmp_path / "demo"
    assert commands.demo_main(["--out", str(out), "--steps", "4", "--threads", "1", "--samples-tokens", "8"]) == 0
    text = capsys.readouterr().out
    assert "validation, whole split:" in text and "gzip -9 on the same text:" in text
    assert text.count("--- sample") == len(commands.DEMO_PROMPTS)
    assert (out / "loss.png").is_file()
    assert json.loads((out / MARKER_NAME).read_text())["created_by"] == "k3 demo"
    # a second demo replaces its own folder but refuses to delete anything else
    assert commands.demo_main(["--out", str(out), "--steps", "1", "--threads", "1", "--samples-tokens", "2"]) == 0
    assert json.loads((out / MARKER_NAME).read_text())["created_by"] == "k3 demo"
    other = tmp_path / "precious"
    other.mkdir()
    (other / "thesis.tex").write_text("years of work")
    assert commands.demo_main(["--out", str(other), "--steps", "1"]) == 2
    assert "not a k3 run directory" in capsys.readouterr().err
    assert [p.name for p in other.iterdir()] == ["thesis.tex"]
