"""Pack documents into one token stream and serve fixed-length (input_ids, labels) batches.

Stream: ``doc_0 EOS doc_1 EOS ... doc_n EOS`` — every document is followed by the EOS id, so EOS
separates documents and the model learns to end one. The training stream uses a seeded permutation
of the document order (neighbouring rows of a batch then come from unrelated files rather than
from one package of the stdlib); the validation stream keeps the corpus order. A stream is
tokenized once and cached as ``.npy`` (uint16 when the vocabulary fits, else uint32) under
``$K3_CACHE_DIR/tokens/``, keyed by (corpus fingerprint, split, tokenizer, seed), with the sha256 of
the file in ``<key>.npy.sha256`` beside it; a cache whose bytes no longer match is rebuilt (with a
warning naming it), then read back as a memory map.

Batches: a cursor ``pos`` walks the stream. A batch of B rows × T tokens takes the
``world_size·B·T + 1`` tokens at ``pos``; rank r keeps rows ``r·B … r·B+B−1``;
``input_ids = w[:-1]``, ``labels = w[1:]`` (each row shifted by one), then ``pos += world_size·B·T``.
When fewer tokens are left the cursor wraps to 0 and ``epoch`` grows. T may change from one batch
to the next (context-length curriculum); the position stays a plain dict of ints, so resuming from
``state_dict()`` reproduces the remaining batches exactly.
"""

from __future__ import annotations

import hashlib
import io
import os
import warnings
from pathlib import Path
from typing import Iterable, Iterator, Sequence

import numpy as np
import torch

from k3.data.corpus import Corpus
from k3.data.tokenizer import Tokenizer, cache_dir
from k3.errors import K3Error
from k3.fsutil import atomic_write

__all__ = ["pack_documents", "token_dtype", "build_token_stream", "PackedBatches",
           "eval_batches", "IGNORE_INDEX"]

IGNORE_INDEX = -100  # label of padded positions in eval batches (cross_entropy's default)


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 2 ** 16 else np.dtype(np.uint32)


def pack_documents(docs: Iterable[Sequence[int]], eos_id: int, dtype=np.uint32) -> np.ndarray:
    """Concatenate token lists, each followed by ``eos_id``: ``[*d0, eos, *d1, eos, ...]``."""
    parts = []
    eos = np.array([eos_id], dtype=dtype)
    for d in docs:
        parts.append(np.asarray(d, dtype=dtype))
        parts.append(eos)
    return np.concatenate(parts) if parts else np.zeros(0, dtype=dtype)


def build_token_stream(corpus: Corpus, tokenizer: Tokenizer, split: str = "train", seed: int = 0,
                       cache: str | os.PathLike | None = None, batch_docs: int = 256) -> np.ndarray:
    """The packed token stream of ``split`` as a read-only memmap (built and cached on first use).

    ``seed`` permutes the training documents (None keeps corpus order); validation is never
    shuffled.
    """
    if split not in ("train", "validation"):
        raise ValueError(f"split must be 'train' or 'validation', got {split!r}")
    seed = seed if split == "train" else None
    key = hashlib.sha256(f"{corpus.fingerprint}\0{split}\0{tokenizer.fingerprint}\0{seed}"
                         .encode()).hexdigest()[:24]
    path = (Path(cache) if cache is not None else cache_dir("tokens")) / f"{key}.npy"
    ok = _cache_verifies(path) if path.is_file() else False
    if path.is_file() and not ok:
        why = "has no checksum file" if ok is None else "does not match its checksum"
        warnings.warn(f"token cache {path} {why} {path.name}{_SUM} (damaged, edited or written by an "
                      "older k3); rebuilding it", stacklevel=2)
    if not ok:
        texts = list(corpus.documents(split))
        if not texts:
            raise K3Error(f"corpus {corpus.name} has no {split} documents")
        if seed is not None:
            texts = [texts[k] for k in np.random.default_rng(seed).permutation(len(texts))]
        dtype = token_dtype(tokenizer.vocab_size)
        # pack per batch of documents: a list of Python ints would cost ~30x the array's memory
        parts = [pack_documents(tokenizer.encode_batch(texts[s:s + batch_docs]),
                                tokenizer.eos_token_id, dtype)
                 for s in range(0, len(texts), batch_docs)]
        buf = io.BytesIO()
        np.save(buf, np.concatenate(parts))
        data = buf.getvalue()
        atomic_write(path, lambda f: f.write(data), binary=True)
        atomic_write(path.with_name(path.name + _SUM), lambda f: f.write(hashlib.sha256(data).hexdigest() + "\n"))
    return np.load(path, mmap_mode="r")


_SUM = ".sha256"


def _cache_verifies(path: Path) -> bool | None:
    """Whether the cached ``.npy`` has the sha256 stored beside it when it was written (None: no
    readable checksum file)."""
    try:
        want = path.with_name(path.name + _SUM).read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest() == want


class PackedBatches:
    """Deterministic, resumable iterator of ``(input_ids, labels)`` int64 tensors ``[B, T]``.

    ``next_batch(seq_len)`` takes the batch at the cursor with that T (default: ``self.seq_len``);
    iterating calls ``next_batch()`` forever (wrapping around epochs).
    """

    def __init__(self, tokens: np.ndarray, batch_size: int, seq_len: int, rank: int = 0,
                 world_size: int = 1):
        if batch_size <= 0 or seq_len <= 0:
            raise ValueError(f"batch_size and seq_len must be > 0, got {batch_size}, {seq_len}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, world_size), got {rank} of {world_size}")
        self.tokens = tokens
        self.batch_size, self.seq_len = batch_size, seq_len
        self.rank, self.world_size = rank, world_size
        self.pos = 0
        self.epoch = 0
        self.batches = 0

    def _span(self, seq_len: int) -> int:
        return self.world_size * self.batch_size * seq_len

    def next_batch(self, seq_len: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        T = self.seq_len if seq_len is None else seq_len
        span = self._span(T)
        if span + 1 > len(self.tokens):
            raise ValueError(f"a batch needs {span + 1} tokens but the stream has "
                             f"{len(self.tokens)}; lower batch_size or seq_len")
        if self.pos + span + 1 > len(self.tokens):
            self.pos, self.epoch = 0, self.epoch + 1
        w = np.asarray(self.tokens[self.pos:self.pos + span + 1], dtype=np.int64)
        w = torch.from_numpy(w)
        B = self.batch_size
        lo = self.rank * B * T
        x = w[lo:lo + B * T].view(B, T)
        y = w[lo + 1:lo + B * T + 1].view(B, T)
        self.pos += span
        self.batches += 1
        return x, y

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        while True:
            yield self.next_batch()

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    def state_dict(self) -> dict[str, int]:
        return {"pos": self.pos, "epoch": self.epoch, "batches": self.batches,
                "seq_len": self.seq_len, "batch_size": self.batch_size,
                "world_size": self.world_size, "num_tokens": len(self.tokens)}

    def load_state_dict(self, state: dict[str, int]) -> None:
        for k in ("batch_size", "world_size", "num_tokens"):
            mine = getattr(self, k)
            if k in state and state[k] != mine:
                raise ValueError(f"data state has {k}={state[k]} but this loader has {mine}; "
                                 "resuming would not reproduce the run")
        self.pos, self.epoch = int(state["pos"]), int(state["epoch"])
        self.batches = int(state.get("batches", 0))
        self.seq_len = int(state.get("seq_len", self.seq_len))


def eval_batches(tokens: np.ndarray, batch_size: int, seq_len: int,
                 max_batches: int | None = None) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Non-overlapping windows covering the whole stream once (every token after the first is a
    label exactly once), the last batch padded with ``IGNORE_INDEX`` labels (inputs padded with 0). Summing the loss over labels and dividing by ``ln 2 · corpus.val_bytes`` gives bits per
    byte."""
    n = len(tokens) - 1  # number of (input, label) pairs
    rows = -(-n // seq_len)
    for b, r0 in enumerate(range(0, rows, batch_size)):
        if max_batches is not None and b >= max_batches:
            return
        r1 = min(r0 + batch_size, rows)
        x = torch.zeros(r1 - r0, seq_len, dtype=torch.long)
        y = torch.full((r1 - r0, seq_len), IGNORE_INDEX, dtype=torch.long)
        s, e = r0 * seq_len, min(r1 * seq_len, n)
        flat_x = torch.from_numpy(np.asarray(tokens[s:e], dtype=np.int64))
        flat_y = torch.from_numpy(np.asarray(tokens[s + 1:e + 1], dtype=np.int64))
        x.view(-1)[:e - s] = flat_x
        y.view(-1)[:e - s] = flat_y
        yield x, y
