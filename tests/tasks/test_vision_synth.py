"""Synthetic image questions: deterministic per seed, labels agree with the pixel solvers, JSONL rows load."""

from __future__ import annotations

import json

import numpy as np
import pytest
from PIL import Image, ImageDraw

from k3.data.images import load_image, preprocess
from k3.errors import K3Error
from k3.tasks.vision_synth import (CELLS, KINDS, PALETTE, check_text, make_image_item, solve, verify_item,
                                   write_jsonl)
from k3.config.vision import ImageProcConfig

SEEDS = range(50)


@pytest.mark.parametrize("kind", KINDS)
def test_deterministic_per_seed_and_in_range(kind):
    answers = set()
    for seed in range(8):
        a, b = make_image_item(seed, kind), make_image_item(seed, kind)
        assert a["question"] == b["question"] and a["answer"] == b["answer"] and a["meta"] == b["meta"]
        assert np.array_equal(np.asarray(a["image"]), np.asarray(b["image"]))
        assert a["image"].mode == "RGB" and a["kind"] == kind
        assert all(56 <= s <= 224 for s in a["image"].size)
        assert a["answer"] == a["answer"].lower() and a["answer"].strip() == a["answer"] != ""
        json.dumps(a["meta"])
        answers.add(a["answer"])
    assert len(answers) > 1                                  # seeds give different items
    assert not np.array_equal(np.asarray(make_image_item(0, kind)["image"]),
                              np.asarray(make_image_item(1, kind)["image"]))


@pytest.mark.parametrize("kind", ["count", "color", "position"])
def test_solver_agrees_with_label(kind):
    seen = set()
    for seed in SEEDS:
        item = make_image_item(seed, kind)
        got = solve(item["image"], item["question"])
        assert got == item["answer"], (seed, item["question"], got, item["answer"])
        seen.add(item["answer"])
    if kind == "count":
        assert seen <= {"1", "2", "3", "4", "5"} and len(seen) >= 4
    elif kind == "color":
        assert seen <= set(PALETTE) and len(seen) >= 5
    else:
        assert seen <= set(CELLS) and len(seen) >= 7


def test_text_items_are_legible_by_bbox():
    kinds = set()
    for seed in SEEDS:
        item = make_image_item(seed, "text")
        assert check_text(item["image"], item["meta"]), seed
        assert verify_item(item)
        kinds.add(item["question"])
        ans = item["answer"]
        assert ans.isdigit() if "number" in item["question"] else ans.isalpha()
        assert item["meta"]["font_size"] >= 16
    assert kinds == {"What number is written?", "What word is written?"}


def test_solvers_catch_wrong_labels():
    # controls for the solvers: a mislabelled or damaged item is caught
    item = make_image_item(3, "count")
    assert verify_item(item)
    assert not verify_item({**item, "answer": str(int(item["answer"]) + 1)})
    im = item["image"].copy()                                 # add one more target shape in a free corner
    target = item["meta"]["target"]
    blank = Image.new("RGB", (im.width + 40, im.height), tuple(item["meta"]["background"]))
    blank.paste(im, (0, 0))
    d = ImageDraw.Draw(blank)
    box = (im.width + 10, 10, im.width + 30, 30)
    if target == "circle":
        d.ellipse(box, fill=PALETTE["red"])
    elif target == "square":
        d.rectangle(box, fill=PALETTE["red"])
    else:
        d.polygon([(box[0] + 10, box[1]), (box[2], box[3]), (box[0], box[3])], fill=PALETTE["red"])
    assert solve(blank, item["question"]) == str(int(item["answer"]) + 1)
    col = make_image_item(4, "color")
    assert not verify_item({**col, "answer": next(c for c in PALETTE if c != col["answer"])})
    pos = make_image_item(5, "position")
    assert not verify_item({**pos, "answer": next(c for c in CELLS if c != pos["answer"])})
    txt = make_image_item(6, "text")
    blank = Image.new("RGB", txt["image"].size, tuple(txt["meta"]["background"]))
    assert not check_text(blank, txt["meta"])                 # no ink
    shifted = Image.new("RGB", txt["image"].size, tuple(txt["meta"]["background"]))
    shifted.paste(txt["image"], (txt["image"].width - txt["meta"]["bbox"][0] - 3, 0))   # ink off the edge
    assert not check_text(shifted, txt["meta"])
    with pytest.raises(K3Error, match="unknown vision_synth kind"):
        make_image_item(0, "colour")
    with pytest.raises(K3Error, match="no solver"):
        solve(txt["image"], txt["question"])


def test_write_jsonl_rows_parse_and_images_exist(tmp_path):
    out = tmp_path / "data" / "vision.jsonl"
    img_dir = tmp_path / "data" / "images"
    n = write_jsonl(out, range(3), KINDS, img_dir)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert n == len(rows) == 3 * len(KINDS)
    urls = []
    for row, (seed, kind) in zip(rows, [(s, k) for s in range(3) for k in KINDS]):
        user, asst = row["messages"]
        assert user["role"] == "user" and asst["role"] == "assistant"
        img_part, text_part = user["content"]
        assert img_part["type"] == "image_url" and text_part["type"] == "text"
        item = make_image_item(seed, kind)
        assert text_part["text"] == item["question"] and asst["content"] == item["answer"]
        assert row["meta"]["seed"] == seed and row["meta"]["kind"] == kind
        url = img_part["image_url"]["url"]
        assert not url.startswith("/") and (out.parent / url).is_file()
        assert np.array_equal(np.asarray(load_image(url, base_dir=out.parent)), np.asarray(item["image"]))
        urls.append(url)
    pv, grids, sizes = preprocess(urls, ImageProcConfig(), base_dir=out.parent)
    assert pv.shape[0] == int(grids.prod(1).sum()) and len(sizes) == n
    # data-URL rows: the same pixels without files
    out2 = tmp_path / "inline.jsonl"
    assert write_jsonl(out2, [7], ["color", "text"]) == 2
    for row, kind in zip(map(json.loads, out2.read_text().splitlines()), ["color", "text"]):
        url = row["messages"][0]["content"][0]["image_url"]["url"]
        assert url.startswith("data:image/png;base64,")
        assert np.array_equal(np.asarray(load_image(url)), np.asarray(make_image_item(7, kind)["image"]))
