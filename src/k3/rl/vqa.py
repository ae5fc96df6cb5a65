"""Answering the synthetic image questions (``k3.tasks.vision_synth``) with a model: exact match.

``answer_items(model, tokenizer, items, with_image=True)`` renders each item as the user turn the
training rows hold (the image part, then the question; ``with_image=False``: the question alone,
the text-only control), decodes greedily through the engine, and compares the reply's content,
stripped, with the item's answer. ``accuracy(rows)`` tallies the rows per kind and overall.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Iterable

from k3.data.chat import ChatFormat
from k3.infer.engine import Engine
from k3.infer.sampling import SamplingParams
from k3.tasks.vision_synth import png_data_url

__all__ = ["user_turn", "answer_items", "accuracy"]


def user_turn(item: dict, with_image: bool = True, url: str | None = None) -> dict:
    """The user message of ``item``: its image (``url``, or the PIL image itself) then its question."""
    parts = [{"type": "text", "text": item["question"]}]
    if with_image:
        parts.insert(0, {"type": "image_url", "image_url": {"url": url if url is not None else png_data_url(item["image"])}})
    return {"role": "user", "content": parts}


def answer_items(model, tokenizer, items: Iterable[dict], with_image: bool = True,
                 max_tokens: int = 16, max_batch: int = 16) -> list[dict]:
    """One row per item: kind, answer, the model's reply, and whether it matched exactly."""
    items = list(items)
    vision = getattr(model, "image_proc", None) if with_image else None
    fmt = ChatFormat(tokenizer, vision)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, stop_token_ids=(fmt.end_id,))
    with Engine(model, tokenizer=tokenizer, max_batch=max_batch) as eng:
        handles = []
        for it in items:
            chat = fmt.render_chat([user_turn(it, with_image)])
            handles.append(eng.submit(chat.ids, params, images=[im.image for im in chat.images] or None))
        rows = []
        for it, h in zip(items, handles):
            out = h.result()
            reply = fmt.parse(out.token_ids, out.finish_reason).content or ""
            rows.append({"kind": it["kind"], "seed": it["meta"]["seed"], "answer": it["answer"],
                         "reply": reply.strip(), "correct": reply.strip() == it["answer"]})
    return rows


def accuracy(rows: Iterable[dict]) -> dict[str, dict]:
    """{kind: {"n", "correct", "accuracy"}} plus "all"."""
    tally: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for r in rows:
        for key in (r["kind"], "all"):
            tally[key][0] += 1
            tally[key][1] += int(r["correct"])
    return {k: {"n": n, "correct": c, "accuracy": c / n} for k, (n, c) in tally.items()}
