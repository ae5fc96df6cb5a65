"""Synthetic image questions with exact answers (issue 34): local, deterministic, verifiable.

    make_image_item(seed, kind) -> {"image": PIL RGB, "question", "answer", "kind", "meta"}

Kinds (answers are lowercase words or digits):

- ``count``    N ∈ 1…5 shapes of one kind among 0…3 distractors of another kind, each of a random
               palette colour; "How many circles are there?" -> "3".
- ``color``    one shape; "What colour is the square?" -> "blue".
- ``position`` a 3×3 grid with one marked shape (the only pixels of its colour) and up to four
               distractors in other cells; "Which cell is the red circle in?" -> "top-left"
               (rows top / middle / bottom, columns left / center / right; the middle cell is
               "center").
- ``text``     a word or a number drawn with PIL's default font (size 16–32 px);
               "What word is written?" / "What number is written?" -> "apple" / "472".

Images are W × H with 56 ≤ W, H ≤ 224, drawn without anti-aliasing (shapes keep their exact
palette colour) on a light background; everything comes from ``random.Random(f"k3.vision_synth/
{kind}/{seed}")``. :func:`solve` reads the answer back from the pixels alone (flood-fill
components classified by their fill ratio; the mode colour; the marked colour's centroid) and
:func:`check_text` checks that a text item's ink lies inside the image, never touching its edge —
the tests hold the generator's labels to them. :func:`write_jsonl` writes chat rows.
"""

from __future__ import annotations

import base64
import io
import json
import os
import random
import re
from collections import deque
from pathlib import Path
from typing import Iterable

import numpy as np
from PIL import Image, ImageDraw, ImageFont

from k3.errors import K3Error

__all__ = ["KINDS", "PALETTE", "SHAPES", "CELLS", "make_image_item", "solve", "check_text", "verify_item",
           "write_jsonl", "png_data_url"]

KINDS = ("count", "color", "position", "text")
PALETTE = {"red": (230, 25, 25), "green": (20, 160, 40), "blue": (30, 60, 230), "yellow": (240, 200, 0),
           "purple": (130, 40, 170), "orange": (250, 120, 10), "black": (0, 0, 0)}
BACKGROUNDS = ((255, 255, 255), (238, 238, 238), (250, 244, 228))
SHAPES = ("circle", "square", "triangle")
_PLURAL = {"circle": "circles", "square": "squares", "triangle": "triangles"}
ROWS, COLS = ("top", "middle", "bottom"), ("left", "center", "right")
CELLS = tuple("center" if (r, c) == ("middle", "center") else f"{r}-{c}" for r in ROWS for c in COLS)
GRID_LINE = (150, 150, 150)
WORDS = ("apple", "river", "cloud", "tiger", "stone", "green", "house", "light", "music", "bread",
         "chair", "ocean", "plant", "smile", "train", "water", "zebra", "lemon", "robot", "candle",
         "forest", "garden", "pencil", "window", "rocket", "silver", "button", "castle", "kitten", "market")
MIN_SIDE, MAX_SIDE = 56, 224


def _draw_shape(draw: ImageDraw.ImageDraw, shape: str, box: tuple[int, int, int, int], colour) -> None:
    """``box`` = (x0, y0, x1, y1) inclusive; a triangle points up with its base on the bottom row."""
    x0, y0, x1, y1 = box
    if shape == "circle":
        draw.ellipse(box, fill=colour)
    elif shape == "square":
        draw.rectangle(box, fill=colour)
    else:
        draw.polygon([((x0 + x1) / 2, y0), (x1, y1), (x0, y1)], fill=colour)


def _place(rng: random.Random, w: int, h: int, sizes: list[int], gap: int = 3):
    """Non-overlapping square boxes (at least ``gap`` px apart and from the border), or None."""
    boxes = []
    for s in sizes:
        for _ in range(200):
            x0, y0 = rng.randint(gap, w - s - gap), rng.randint(gap, h - s - gap)
            b = (x0, y0, x0 + s - 1, y0 + s - 1)
            if all(b[0] > o[2] + gap or o[0] > b[2] + gap or b[1] > o[3] + gap or o[1] > b[3] + gap
                   for o in boxes):
                boxes.append(b)
                break
        else:
            return None
    return boxes


def _canvas(rng: random.Random, lo: int = MIN_SIDE):
    w, h = rng.randint(lo, MAX_SIDE), rng.randint(lo, MAX_SIDE)
    bg = rng.choice(BACKGROUNDS)
    return Image.new("RGB", (w, h), bg), bg


def _count(rng: random.Random):
    target, other = rng.sample(SHAPES, 2)
    n, m = rng.randint(1, 5), rng.randint(0, 3)
    while True:                                   # a canvas the shapes fit on (drawn from rng)
        im, bg = _canvas(rng, lo=96)
        kinds = [target] * n + [other] * m
        rng.shuffle(kinds)
        boxes = _place(rng, *im.size, [rng.randint(14, 26) for _ in kinds])
        if boxes is not None:
            break
    draw = ImageDraw.Draw(im)
    shapes = []
    for k, b in zip(kinds, boxes):
        colour = rng.choice(list(PALETTE))
        _draw_shape(draw, k, b, PALETTE[colour])
        shapes.append({"shape": k, "color": colour, "box": list(b)})
    return im, bg, f"How many {_PLURAL[target]} are there?", str(n), {"target": target, "shapes": shapes}


def _color(rng: random.Random):
    im, bg = _canvas(rng)
    shape, colour = rng.choice(SHAPES), rng.choice(list(PALETTE))
    s = rng.randint(16, min(im.size) - 8)
    (box,) = _place(rng, *im.size, [s])
    _draw_shape(ImageDraw.Draw(im), shape, box, PALETTE[colour])
    return im, bg, f"What colour is the {shape}?", colour, {"shapes": [{"shape": shape, "color": colour,
                                                                          "box": list(box)}]}


def _position(rng: random.Random):
    im, bg = _canvas(rng, lo=84)
    w, h = im.size
    xs, ys = [w * i // 3 for i in range(4)], [h * i // 3 for i in range(4)]
    draw = ImageDraw.Draw(im)
    for i in (1, 2):
        draw.line([(xs[i], 0), (xs[i], h - 1)], fill=GRID_LINE)
        draw.line([(0, ys[i]), (w - 1, ys[i])], fill=GRID_LINE)
    shape, colour = rng.choice(SHAPES), rng.choice(list(PALETTE))
    cells = rng.sample(range(9), 1 + rng.randint(0, 4))
    shapes = []
    for j, cell in enumerate(cells):
        r, c = divmod(cell, 3)
        cw, ch = xs[c + 1] - xs[c], ys[r + 1] - ys[r]
        s = rng.randint(10, min(cw, ch) - 8)
        x0, y0 = rng.randint(xs[c] + 4, xs[c + 1] - 4 - s), rng.randint(ys[r] + 4, ys[r + 1] - 4 - s)
        if j == 0:
            k, col = shape, colour
        else:                                     # distractors never use the marked colour
            k, col = rng.choice(SHAPES), rng.choice([n for n in PALETTE if n != colour])
        _draw_shape(draw, k, (x0, y0, x0 + s - 1, y0 + s - 1), PALETTE[col])
        shapes.append({"shape": k, "color": col, "box": [x0, y0, x0 + s - 1, y0 + s - 1], "cell": CELLS[cell]})
    q = f"Which cell is the {colour} {shape} in? Answer with one of: {', '.join(CELLS)}."
    return im, bg, q, CELLS[cells[0]], {"target": {"shape": shape, "color": colour}, "shapes": shapes}


def _text(rng: random.Random):
    number = rng.random() < 0.4
    word = str(rng.randint(0, 9999)) if number else rng.choice(WORDS)
    font = ImageFont.load_default(size=rng.randint(16, 32))
    x0, y0, x1, y1 = ImageDraw.Draw(Image.new("RGB", (1, 1))).textbbox((0, 0), word, font=font)
    tw, th = x1 - x0, y1 - y0
    w = rng.randint(max(MIN_SIDE, tw + 12), max(MAX_SIDE, tw + 12))
    h = rng.randint(max(MIN_SIDE, th + 12), max(MIN_SIDE, min(MAX_SIDE, 3 * th + 12)))
    if w > MAX_SIDE:
        raise K3Error(f"vision_synth text: {word!r} at this size does not fit {MAX_SIDE} px")
    bg = rng.choice(BACKGROUNDS)
    im = Image.new("RGB", (w, h), bg)
    ox, oy = rng.randint(6, w - tw - 6) - x0, rng.randint(6, h - th - 6) - y0
    draw = ImageDraw.Draw(im)
    ink = rng.choice(["black", "blue", "purple", "red"])
    draw.text((ox, oy), word, fill=PALETTE[ink], font=font)
    q = "What number is written?" if number else "What word is written?"
    return im, bg, q, word, {"bbox": list(draw.textbbox((ox, oy), word, font=font)), "font_size": font.size,
                             "color": ink}


_MAKERS = {"count": _count, "color": _color, "position": _position, "text": _text}


def make_image_item(seed: int, kind: str) -> dict:
    """One item: ``{"image": PIL RGB W×H (56 ≤ W, H ≤ 224), "question", "answer", "kind", "meta"}``,
    the same for the same (seed, kind). ``meta`` is JSON-ready: seed, size, background, and the
    kind's drawing record (shape boxes, or the text's bbox and font size)."""
    if kind not in _MAKERS:
        raise K3Error(f"unknown vision_synth kind {kind!r}; choose one of {', '.join(KINDS)}")
    rng = random.Random(f"k3.vision_synth/{kind}/{seed}")
    im, bg, question, answer, meta = _MAKERS[kind](rng)
    meta = {"seed": seed, "kind": kind, "width": im.width, "height": im.height, "background": list(bg), **meta}
    return {"image": im, "question": question, "answer": answer, "kind": kind, "meta": meta}


# ------------------------------------------------------------------------------------ solvers
def _components(mask: np.ndarray) -> list[np.ndarray]:
    """4-connected components of a boolean [H, W] mask by breadth-first flood fill -> [k, 2] (y, x)."""
    seen = np.zeros_like(mask, bool)
    h, w = mask.shape
    out = []
    for sy, sx in zip(*np.nonzero(mask)):
        if seen[sy, sx]:
            continue
        seen[sy, sx] = True
        pix, todo = [], deque([(sy, sx)])
        while todo:
            y, x = todo.popleft()
            pix.append((y, x))
            for ny, nx in ((y - 1, x), (y + 1, x), (y, x - 1), (y, x + 1)):
                if 0 <= ny < h and 0 <= nx < w and mask[ny, nx] and not seen[ny, nx]:
                    seen[ny, nx] = True
                    todo.append((ny, nx))
        out.append(np.array(pix))
    return out


def _shape_of(pix: np.ndarray) -> str:
    """Fill ratio of a component in its bounding box: square ≈ 1, circle ≈ π/4, triangle ≈ ½."""
    (y0, x0), (y1, x1) = pix.min(0), pix.max(0)
    fill = len(pix) / ((y1 - y0 + 1) * (x1 - x0 + 1))
    return "square" if fill > 0.93 else "circle" if fill > 0.66 else "triangle"


def _background(arr: np.ndarray) -> np.ndarray:
    return arr[0, 0]


def _nearest_colour(rgb) -> str:
    return min(PALETTE, key=lambda n: sum((int(a) - b) ** 2 for a, b in zip(rgb, PALETTE[n])))


def solve(image: Image.Image, question: str) -> str:
    """The answer read from the pixels and the question text alone (count, color and position)."""
    arr = np.asarray(image.convert("RGB"))
    bg = _background(arr)
    ink = np.any(arr != bg, -1) & np.any(arr != GRID_LINE, -1)
    if m := re.fullmatch(r"How many (\w+)s are there\?", question):
        return str(sum(_shape_of(c) == m.group(1) for c in _components(ink)))
    if re.fullmatch(r"What colour is the \w+\?", question):
        values, counts = np.unique(arr[ink].reshape(-1, 3), axis=0, return_counts=True)
        return _nearest_colour(values[counts.argmax()])
    if m := re.match(r"Which cell is the (\w+) \w+ in\?", question):
        ys, xs = np.nonzero(np.all(arr == PALETTE[m.group(1)], -1))
        h, w = arr.shape[:2]
        r, c = int(ys.mean() * 3 // h), int(xs.mean() * 3 // w)
        return CELLS[3 * r + c]
    raise K3Error(f"solve: no solver for the question {question!r} (text items: check_text)")


def check_text(image: Image.Image, meta: dict) -> bool:
    """A text item is legible: its ink (pixels unlike the corner's) is non-empty, at least 8 px
    tall, inside the drawn text box of ``meta['bbox']`` and at least 2 px from every image edge."""
    arr = np.asarray(image.convert("RGB"))
    ys, xs = np.nonzero(np.any(arr != _background(arr), -1))
    if len(ys) == 0:
        return False
    h, w = arr.shape[:2]
    x0, y0, x1, y1 = meta["bbox"]
    inside = x0 <= xs.min() and xs.max() < x1 and y0 <= ys.min() and ys.max() < y1
    margin = xs.min() >= 2 and ys.min() >= 2 and xs.max() <= w - 3 and ys.max() <= h - 3
    return bool(inside and margin and ys.max() - ys.min() + 1 >= 8)


def verify_item(item: dict) -> bool:
    """The item's label agrees with its pixels (:func:`solve`, or :func:`check_text` for text)."""
    if item["kind"] == "text":
        return check_text(item["image"], item["meta"])
    return solve(item["image"], item["question"]) == item["answer"]


# ------------------------------------------------------------------------------------ JSONL
def png_data_url(im: Image.Image) -> str:
    """``im`` as a ``data:image/png;base64`` URL."""
    buf = io.BytesIO()
    im.save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def write_jsonl(path: str | os.PathLike, seeds: Iterable[int], kinds: Iterable[str] = KINDS,
                image_dir: str | os.PathLike | None = None) -> int:
    """Chat rows for every (seed, kind), seeds outer, -> number of rows written to ``path``.

    Row: ``{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url":
    U}}, {"type": "text", "text": question}]}, {"role": "assistant", "content": answer}],
    "meta": meta}``. With ``image_dir`` each image is ``{image_dir}/{kind}_{seed}.png`` and U is its
    path relative to the JSONL file's folder; without it U is a ``data:image/png;base64`` URL.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if image_dir is not None:
        Path(image_dir).mkdir(parents=True, exist_ok=True)
    kinds = list(kinds)
    tmp = path.with_name(path.name + ".tmp")
    n = 0
    with open(tmp, "w", encoding="utf-8") as f:
        for seed in seeds:
            for kind in kinds:
                item = make_image_item(seed, kind)
                meta = dict(item["meta"])
                if image_dir is None:
                    url = png_data_url(item["image"])
                else:
                    file = Path(image_dir) / f"{kind}_{seed}.png"
                    item["image"].save(file, "PNG")
                    url = Path(os.path.relpath(file, path.parent)).as_posix()
                    meta["image"] = url
                row = {"messages": [{"role": "user", "content": [
                           {"type": "image_url", "image_url": {"url": url}},
                           {"type": "text", "text": item["question"]}]},
                       {"role": "assistant", "content": item["answer"]}], "meta": meta}
                f.write(json.dumps(row) + "\n")
                n += 1
    os.replace(tmp, path)
    return n
