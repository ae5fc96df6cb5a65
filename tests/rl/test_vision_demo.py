"""``k3 vision-demo`` plumbing at nano scale (the real run is ``make vision-demo``): both models are
trained from one base, the control never sees an image, the report counts every held-out item;
``k3.rl.vqa`` scores replies by exact match."""

from __future__ import annotations

import json

from k3.cli.vision_demo import VisionDemo, control_rows, vision_demo_main
from k3.rl.vqa import accuracy
from k3.tasks.vision_synth import write_jsonl

TEXT = "What colour is the square? red. How many circles are there? 3. Which cell is it in? top-left. " * 10


def test_control_rows_drop_only_the_images(tmp_path):
    write_jsonl(tmp_path / "img.jsonl", range(3), kinds=("color", "text"))
    assert control_rows(tmp_path / "img.jsonl", tmp_path / "ctl.jsonl") == 6
    for a, b in zip((tmp_path / "img.jsonl").read_text().splitlines(), (tmp_path / "ctl.jsonl").read_text().splitlines()):
        a, b = json.loads(a), json.loads(b)
        parts = a["messages"][0]["content"]
        assert any(p["type"] == "image_url" for p in parts)                       # the source has its image
        assert b["messages"][0]["content"] == [p for p in parts if p["type"] == "text"]
        assert b["messages"][1:] == a["messages"][1:] and b["meta"] == a["meta"]


def test_accuracy_tallies_per_kind():
    rows = [{"kind": "color", "correct": True}, {"kind": "color", "correct": False}, {"kind": "count", "correct": True}]
    acc = accuracy(rows)
    assert acc["color"] == {"n": 2, "correct": 1, "accuracy": 0.5}
    assert acc["all"] == {"n": 3, "correct": 2, "accuracy": 2 / 3}


def test_the_demo_trains_both_models_and_scores_every_item(tmp_path, make_nano_checkpoint):
    base, _, _ = make_nano_checkpoint(tmp_path / "base", TEXT)
    rep = VisionDemo(base, tmp_path / "out", train_seeds=4, heldout=2, kinds=("color", "count"), steps=2,
                     batch_size=2, seq_len=160, tower="nano", threads=1).run(log=lambda *a: None)
    for name in ("vision", "control"):
        assert rep["accuracy"][name]["all"]["n"] == 4
        assert {k: v["n"] for k, v in rep["accuracy"][name].items()} == {"color": 2, "count": 2, "all": 4}
    assert rep["sft"]["vision"]["train_images"] == 8 and rep["sft"]["control"]["train_images"] == 0
    cfg = json.loads((tmp_path / "out" / "vision" / "checkpoint" / "model" / "config.json").read_text())
    assert "vision_config" in cfg
    ctl = json.loads((tmp_path / "out" / "control" / "checkpoint" / "model" / "config.json").read_text())
    assert "vision_config" not in ctl                                              # the control is text only
    answers = [json.loads(x) for x in (tmp_path / "out" / "answers.jsonl").read_text().splitlines()]
    assert len(answers) == 8 and all(a["correct"] == (a["reply"] == a["answer"]) for a in answers)
    assert rep["machine"] and rep["date"]


def test_bad_flags_are_one_line(capsys):
    assert vision_demo_main(["--kinds", "color,smell"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--kinds: smell" in err and len(err.splitlines()) == 1
    assert vision_demo_main(["--steps", "0"]) == 2
    assert "--steps must be >= 1" in capsys.readouterr().err
