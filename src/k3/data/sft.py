"""Supervised fine-tuning data (SPEC §10): chat conversations -> masked, packed training rows.

Input: JSONL files of conversations, one object per line::

    {"messages": [OpenAI messages: system / user / assistant (reasoning_content, content,
                  tool_calls) / tool (tool_call_id, content)],
     "tools": [OpenAI tool schemas] (optional), "reasoning_effort": "low" | "high" | "max" (optional),
     "meta": {...} (optional, kept for reports)}

A directory stands for the ``*.jsonl`` files under it (sorted). Each conversation renders through
the one renderer (``ChatFormat.render_for_training``): loss only on what the assistant wrote (its
reasoning, ``</think>``, content, tool-call section and ``<|im_end|>``), never on system, user or
tool-result tokens. A bad row is an error naming the file, the line and the field;
``skip_bad=True`` counts and reports bad rows instead. ``read_rows`` may be replaced by a caller
that knows other formats (``k3.rl.sft`` adds trajectories); it yields ``(where, row)`` pairs.

Split: a conversation goes to validation when the sha256 of its rendered ids falls in the first
``val_percent`` of 100 buckets (stable under reordering or adding files).

Packing (training rows of ``seq_len`` tokens): each epoch takes the training conversations in a
permutation seeded by (seed, epoch) and fills rows in that order, a conversation going into the
current row when it fits and starting a new one otherwise; the rest of a row is padding (token
0, its own document id, no loss). ``input_ids[t]`` is token t; ``labels[t]`` is token t + 1 when
both lie in the same conversation and t + 1 carries loss, else ``IGNORE_INDEX``; ``doc_ids`` marks
the conversations, so the model runs each alone (``K3Model.forward(doc_ids=...)``). A conversation
longer than ``seq_len`` keeps its first ``seq_len`` tokens (counted as truncated); one left with no
trained token is dropped (counted). The batch cursor (epoch, row) is the resumable state.

Images (a vision model: ``image_proc`` given): a user or tool message may hold image parts
(``k3.data.chat``; a relative path is read under the JSONL file's folder). A conversation keeps its
images' sources (a data URL, or the file's absolute path) and a digest of their pixels (part of the
data fingerprint and of the split bucket); each batch then carries ``pixel_values`` and
``grid_thws`` of its rows' images in token order (row-major across the batch), preprocessed when
the batch is made. A truncated conversation is cut before the first media block that would not fit
whole, so a row never holds half an image.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence

import numpy as np
import torch

from k3.config.vision import ImageProcConfig
from k3.data.chat import EFFORTS, ChatFormat, ChatImage
from k3.data.images import preprocess
from k3.data.packing import IGNORE_INDEX
from k3.data.tokenizer import Tokenizer
from k3.errors import ConfigError, K3Error

__all__ = ["SFTError", "Conversation", "ChatData", "SFTBatches", "read_chat_rows", "read_chat_file", "jsonl_files",
           "ROW_KEYS"]

ROW_KEYS = {"messages", "tools", "reasoning_effort", "meta", "metadata", "parallel_tool_calls"}


class SFTError(K3Error):
    """A bad SFT row: names the file, the line and the field."""


@dataclass
class Conversation:
    where: str                 # "file:line"
    ids: list[int]
    mask: list[int]
    meta: dict = field(default_factory=dict)
    images: list[str] = field(default_factory=list)   # sources, in token order
    image_digest: str = ""                             # sha256 of their pixels ("" without images)

    @property
    def trained(self) -> int:
        return sum(self.mask)


def jsonl_files(path: str | os.PathLike) -> list[Path]:
    """The JSONL files ``path`` names: itself, or the ``*.jsonl`` under a directory (sorted)."""
    p = Path(path)
    if p.is_dir():
        files = sorted(f for f in p.rglob("*.jsonl") if f.is_file())
        if not files:
            raise ConfigError(f"--data {p}: the directory holds no .jsonl files")
        return files
    if not p.is_file():
        raise ConfigError(f"--data {p}: no such file or directory")
    return [p]


def read_chat_rows(path: str | os.PathLike, include_failed: bool = False) -> Iterator[tuple[str, Any]]:
    """``(where, row)`` for every non-blank line of the JSONL files under ``path``; a line that is
    not JSON yields an ``SFTError`` in place of the row (so ``skip_bad`` can count it).
    ``include_failed`` is for readers that know trajectories (``k3.rl.sft``); plain chats have no
    verdict."""
    for f in jsonl_files(path):
        yield from read_chat_file(f)


def read_chat_file(f: Path) -> Iterator[tuple[str, Any]]:
    """The rows of one chat JSONL file (see ``read_chat_rows``)."""
    with open(f, encoding="utf-8", errors="strict") as fh:
        try:
            for n, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    yield f"{f}:{n}", json.loads(line)
                except ValueError as e:
                    yield f"{f}:{n}", SFTError(f"{f}:{n}: not a JSON object ({e})")
        except UnicodeDecodeError as e:
            yield f"{f}", SFTError(f"{f}: not UTF-8 text ({e})")


def _base_dir(where: str) -> Path | None:
    """The folder of the file a row came from (``where`` is ``file:line`` or ``file``)."""
    head, _, line = where.rpartition(":")
    path = Path(head if line.isdigit() else where)
    return path.parent if path.parent != Path("") else None


def _image_source(im: ChatImage, base_dir: Path | None) -> str:
    """What the batch reopens: a data URL as sent, a file path made absolute."""
    if im.source.startswith("data:"):
        return im.source
    p = Path(im.source)
    return str(p if p.is_absolute() or base_dir is None else (base_dir / p).absolute())


def _image_digest(images: Sequence[ChatImage]) -> str:
    if not images:
        return ""
    h = hashlib.sha256()
    for im in images:
        h.update(f"{im.image.mode}:{im.size[0]}x{im.size[1]}:".encode())
        h.update(im.image.tobytes())
    return h.hexdigest()


def _conversation(fmt: ChatFormat, where: str, row: Any) -> Conversation:
    if isinstance(row, SFTError):
        raise row
    if not isinstance(row, dict):
        raise SFTError(f"{where}: a row must be a JSON object with 'messages', got {type(row).__name__}")
    unknown = sorted(set(row) - ROW_KEYS)
    if unknown:
        raise SFTError(f"{where}: unknown field {unknown[0]!r} (a row has {', '.join(sorted(ROW_KEYS))})")
    msgs = row.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise SFTError(f"{where}: messages must be a non-empty list")
    effort = row.get("reasoning_effort")
    if effort is not None and effort not in EFFORTS:
        raise SFTError(f"{where}: reasoning_effort must be one of {', '.join(EFFORTS)}, got {effort!r}")
    meta = row.get("meta", row.get("metadata")) or {}
    if not isinstance(meta, dict):
        raise SFTError(f"{where}: meta must be an object")
    base = _base_dir(where)
    try:
        r = fmt.render_chat(msgs, tools=row.get("tools"), reasoning_effort=effort,
                            add_generation_prompt=False, base_dir=base)
    except K3Error as e:
        raise SFTError(f"{where}: {e}") from None
    if not any(m.get("role") == "assistant" for m in msgs):
        raise SFTError(f"{where}: messages has no assistant message (nothing to train on)")
    return Conversation(where, r.ids, r.mask, dict(meta), [_image_source(im, base) for im in r.images],
                        _image_digest(r.images))


def _truncate(conv: Conversation, seq_len: int, fmt: ChatFormat) -> None:
    """Cut ``conv`` to at most ``seq_len`` tokens, before any media block that would not fit whole
    (its images after the cut are dropped with it)."""
    cut = seq_len
    if conv.images:
        begin, end = fmt.media_ids["<|media_begin|>"], fmt.media_ids["<|media_end|>"]
        starts = [i for i, t in enumerate(conv.ids) if t == begin]
        ends = [i for i, t in enumerate(conv.ids) if t == end]
        kept = 0
        for s, e in zip(starts, ends):
            if e >= seq_len:
                cut = min(cut, s)
                break
            kept += 1
        conv.images = conv.images[:kept]
    conv.ids, conv.mask = conv.ids[:cut], conv.mask[:cut]


def _val_bucket(conv: Conversation) -> int:
    h = hashlib.sha256(np.asarray(conv.ids, dtype=np.int64).tobytes())
    h.update(conv.image_digest.encode())
    return int.from_bytes(h.digest()[:8], "big") % 100


class ChatData:
    """Conversations of an SFT run: rendered, split, with what the Trainer reports about its data.

    ``rows``: ``(where, row)`` pairs (``read_chat_rows`` of ``path`` by default). ``image_proc``: a
    vision model's preprocessing (images allowed; batches carry pixels), else images are refused.
    """

    def __init__(self, path: str | os.PathLike, tokenizer: Tokenizer, seq_len: int, val_percent: int = 2,
                 skip_bad: bool = False, include_failed: bool = False,
                 read_rows: Callable[..., Iterable[tuple[str, Any]]] = read_chat_rows,
                 image_proc: ImageProcConfig | None = None):
        self.name = f"chat:{path}"
        self.path = str(path)
        self.tokenizer = tokenizer
        self.seq_len = seq_len
        self.image_proc = image_proc
        fmt = ChatFormat(tokenizer, image_proc)
        self.bad: list[str] = []
        self.truncated = self.dropped = 0
        train: list[Conversation] = []
        val: list[Conversation] = []
        h = hashlib.sha256()
        for where, row in read_rows(path, include_failed=include_failed):
            try:
                conv = _conversation(fmt, where, row)
            except SFTError as e:
                if not skip_bad:
                    raise
                self.bad.append(str(e))
                continue
            if len(conv.ids) > seq_len:
                _truncate(conv, seq_len, fmt)
                self.truncated += 1
            if sum(conv.mask[1:]) == 0:  # the first token is never a label
                self.dropped += 1
                continue
            h.update(np.asarray(conv.ids, dtype=np.int64).tobytes())
            h.update(np.asarray(conv.mask, dtype=np.int8).tobytes())
            h.update(conv.image_digest.encode())
            (val if _val_bucket(conv) < val_percent else train).append(conv)
        if not train:
            raise ConfigError(f"--data {path}: no training conversation"
                              + (f" ({len(self.bad)} bad rows skipped)" if self.bad else ""))
        self.train, self.validation = train, val
        self.fingerprint = h.hexdigest()
        self.token_bytes: torch.Tensor | None = None

    # the corpus-like surface the Trainer reports
    @property
    def val_bytes(self) -> int:
        return 0

    def doc_digests(self) -> dict[str, str]:
        return {c.where: hashlib.sha256(np.asarray(c.ids, dtype=np.int64).tobytes()
                                        + c.image_digest.encode()).hexdigest()[:16]
                for c in self.train + self.validation}

    def counts(self) -> dict[str, int]:
        return {"train_conversations": len(self.train), "val_conversations": len(self.validation),
                "train_tokens": sum(len(c.ids) for c in self.train),
                "trained_tokens": sum(c.trained for c in self.train),
                "train_images": sum(len(c.images) for c in self.train),
                "bad_rows": len(self.bad), "truncated": self.truncated, "dropped": self.dropped}

    def summary(self) -> str:
        c = self.counts()
        extra = [f"{c[k]} {k.replace('_', ' ')}" for k in ("bad_rows", "truncated", "dropped") if c[k]]
        images = f", {c['train_images']:,} images" if c["train_images"] else ""
        return (f"sft data {self.path}: {c['train_conversations']} training conversations "
                f"({c['train_tokens']:,} tokens, {c['trained_tokens']:,} with loss{images}), "
                f"{c['val_conversations']} validation" + (f"; {', '.join(extra)}" if extra else ""))

    def batches(self, batch_size: int, seed: int) -> "SFTBatches":
        return SFTBatches(self.train, batch_size, self.seq_len, seed, self.image_proc)

    def eval_batches(self, batch_size: int, max_batches: int | None = None):
        """Validation rows packed in corpus order, B at a time (the last batch may be short)."""
        rows = pack_rows(self.validation, self.seq_len)
        for b, r0 in enumerate(range(0, len(rows), batch_size)):
            if max_batches is not None and b >= max_batches:
                return
            yield _stack(rows[r0:r0 + batch_size], self.seq_len, self.image_proc)


def pack_rows(convs: Sequence[Conversation], seq_len: int) -> list[list[Conversation]]:
    """Conversations in order, each into the current row when it fits, else into a new row."""
    rows: list[list[Conversation]] = []
    used = seq_len + 1
    for c in convs:
        n = len(c.ids)
        if used + n > seq_len:
            rows.append([])
            used = 0
        rows[-1].append(c)
        used += n
    return rows


def _stack(rows: Sequence[Sequence[Conversation]], T: int, image_proc: ImageProcConfig | None = None) -> tuple:
    """(input_ids, labels, doc_ids) int64 [len(rows), T] (module docstring); with ``image_proc``
    also (pixel_values, grid_thws) of the rows' images in token order."""
    B = len(rows)
    x = torch.zeros(B, T, dtype=torch.long)
    y = torch.full((B, T), IGNORE_INDEX, dtype=torch.long)
    d = torch.zeros(B, T, dtype=torch.long)
    for r, row in enumerate(rows):
        s = 0
        for j, c in enumerate(row):
            n = len(c.ids)
            ids = torch.tensor(c.ids, dtype=torch.long)
            x[r, s:s + n] = ids
            keep = torch.tensor(c.mask[1:], dtype=torch.bool)
            y[r, s:s + n - 1] = torch.where(keep, ids[1:], IGNORE_INDEX)
            d[r, s:s + n] = j
            s += n
        d[r, s:] = len(row)  # padding: a document of its own
    if image_proc is None:
        return x, y, d
    pixel_values, grid_thws, _ = preprocess([src for row in rows for c in row for src in c.images], image_proc)
    return x, y, d, pixel_values, grid_thws


class SFTBatches:
    """Resumable batches of B packed rows: ``next_batch(seq_len) -> (input_ids, labels, doc_ids)``
    (+ ``pixel_values, grid_thws`` with ``image_proc``).

    The state is (epoch, row): rows of epoch e are ``pack_rows`` of the training conversations in
    the permutation of ``default_rng([seed, e])``; an epoch with fewer than B rows left wraps.
    """

    def __init__(self, convs: Sequence[Conversation], batch_size: int, seq_len: int, seed: int,
                 image_proc: ImageProcConfig | None = None):
        self.convs, self.batch_size, self.seq_len, self.seed = list(convs), batch_size, seq_len, seed
        self.image_proc = image_proc
        self.epoch = self.row = self.batches = 0
        self._rows: tuple[int, list] | None = None
        if len(self._epoch_rows()) < batch_size:
            raise ConfigError(f"the SFT data packs into {len(self._epoch_rows())} rows of {seq_len} tokens, "
                              f"fewer than one batch of {batch_size}; add data or lower batch_size / seq_len")

    def _epoch_rows(self) -> list[list[Conversation]]:
        if self._rows is None or self._rows[0] != self.epoch:
            order = np.random.default_rng([self.seed, self.epoch]).permutation(len(self.convs))
            self._rows = (self.epoch, pack_rows([self.convs[i] for i in order], self.seq_len))
        return self._rows[1]

    def rows_per_epoch(self) -> int:
        return len(self._epoch_rows())

    def next_batch(self, seq_len: int | None = None):
        if seq_len is not None and seq_len != self.seq_len:
            raise ConfigError(f"SFT rows are packed at seq_len {self.seq_len}, asked for {seq_len} "
                              "(SFT runs at one sequence length: no curriculum)")
        rows = self._epoch_rows()
        if self.row + self.batch_size > len(rows):
            self.epoch, self.row = self.epoch + 1, 0
            rows = self._epoch_rows()
        batch = _stack(rows[self.row:self.row + self.batch_size], self.seq_len, self.image_proc)
        self.row += self.batch_size
        self.batches += 1
        return batch

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "row": self.row, "batches": self.batches, "seq_len": self.seq_len,
                "batch_size": self.batch_size, "conversations": len(self.convs)}

    def load_state_dict(self, state: dict[str, int]) -> None:
        for k, mine in (("batch_size", self.batch_size), ("seq_len", self.seq_len),
                        ("conversations", len(self.convs))):
            if state.get(k, mine) != mine:
                raise ValueError(f"data state has {k}={state[k]} but this loader has {mine}; "
                                 "resuming would not reproduce the run")
        self.epoch, self.row, self.batches = int(state["epoch"]), int(state["row"]), int(state.get("batches", 0))
