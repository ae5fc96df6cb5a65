"""Byte-level BPE tokenizer trained with HF ``tokenizers`` on a corpus' training split.

Layout of the vocabulary: the special tokens first (``<|endoftext|>`` = id 0, the small presets'
``eos_token_id``), then the 256 byte symbols, then the learned merges up to ``vocab_size``.
Byte-level pre-tokenization without a prefix space and the byte-level decoder make
``decode(encode(s)) == s`` for every str that is valid Unicode (no lone surrogates).

Special-token strings that occur *in data* are encoded as ordinary text (``encode_special_tokens``)
so a corpus can never inject an EOS or a chat marker; pass ``allow_special=True`` to ``encode`` where
a template means them (the chat renderer, ``k3.data.chat``, inserts their ids directly).

The special tokens are ``<|endoftext|>``, then the chat tokens of SPEC §6.3 (``CHAT_TOKENS``, ids
1..13 in that order), then the release's media tokens (``MEDIA_TOKENS``, ids 14..17:
``<|media_begin|>``, ``<|media_content|>``, ``<|media_end|>``, ``<|media_pad|>``; an image renders as
``<|media_begin|>image {W}x{H}<|media_content|>`` + N × ``<|media_pad|>`` + ``<|media_end|>``), all
stored in the tokenizer file as its added tokens. Tokenizer files written by older k3 still load:
without some chat token ``chat_token_ids`` is ``None`` and the chat renderer refuses them; without
the media tokens ``media_token_ids`` is ``None`` and only an image in a chat is refused.

A trained tokenizer is cached at ``$K3_CACHE_DIR/tokenizers/<key>/tokenizer.json``
(``K3_CACHE_DIR`` defaults to ``~/.cache/k3``), key = sha256 of (corpus fingerprint, vocab size,
special tokens, format version: 3 since the media tokens joined, so a tokenizer cached by an older
k3 is never reused for a new run), and saved beside a checkpoint as ``tokenizer.json``. A cached file
that does not parse (truncated, edited) is retrained with a warning naming it.
"""

from __future__ import annotations

import hashlib
import os
import time
import warnings
from pathlib import Path
from typing import Iterable, Sequence

from tokenizers import Tokenizer as _HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from k3.data.corpus import Corpus
from k3.errors import K3Error
from k3.fsutil import atomic_write

__all__ = ["Tokenizer", "train_tokenizer", "get_tokenizer", "cache_dir", "EOS_TOKEN",
           "CHAT_TOKENS", "MEDIA_TOKENS", "SPECIAL_TOKENS"]

EOS_TOKEN = "<|endoftext|>"
# The chat format's markers (SPEC §6.3): roles, thinking tags, tool calls, media; order fixes ids.
CHAT_TOKENS = ("<|im_system|>", "<|im_user|>", "<|im_assistant|>", "<|im_middle|>", "<|im_end|>",
               "<think>", "</think>", "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>",
               "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>",
               "<|media_placeholder|>")
# The release's media markers (research/vision_moonvit.md §4.3; ids 163602..163605 there).
MEDIA_TOKENS = ("<|media_begin|>", "<|media_content|>", "<|media_end|>", "<|media_pad|>")
SPECIAL_TOKENS = (EOS_TOKEN, *CHAT_TOKENS, *MEDIA_TOKENS)
_FORMAT_VERSION = 3
# GPT-2's byte alphabet: printable Latin-1 bytes stand for themselves, the other 68 bytes are
# spelled with code points 256.. in byte order. Byte-level BPE token strings use it.
_PRINTABLE = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
_CHAR_TO_BYTE = {chr(b): b for b in _PRINTABLE}
_CHAR_TO_BYTE.update({chr(256 + n): b for n, b in
                      enumerate(b for b in range(256) if b not in set(_PRINTABLE))})


def cache_dir(sub: str = "") -> Path:
    """``$K3_CACHE_DIR`` (default ``~/.cache/k3``), optionally a subfolder of it."""
    root = Path(os.environ.get("K3_CACHE_DIR") or Path.home() / ".cache" / "k3").expanduser()
    return root / sub if sub else root


class Tokenizer:
    """Thin wrapper over a HF ``tokenizers.Tokenizer`` with K3's conventions."""

    def __init__(self, hf: _HFTokenizer):
        self.hf = hf
        self.hf.encode_special_tokens = True
        eos = hf.token_to_id(EOS_TOKEN)
        if eos is None:
            raise ValueError(f"tokenizer has no {EOS_TOKEN} token")
        self.eos_token_id = eos
        ids = {t: hf.token_to_id(t) for t in CHAT_TOKENS}
        # None for a tokenizer file of older k3 (no chat tokens): the chat renderer refuses it
        self.chat_token_ids: dict[str, int] | None = (
            None if any(i is None for i in ids.values()) else ids)
        self.missing_chat_tokens = tuple(t for t, i in ids.items() if i is None)
        media = {t: hf.token_to_id(t) for t in MEDIA_TOKENS}
        # None for a tokenizer file of k3 before vision: its chats render, images are refused
        self.media_token_ids: dict[str, int] | None = (
            None if any(i is None for i in media.values()) else media)
        self._bytes: list[bytes] | None = None

    # --------------------------------------------------------------------------------- io
    @classmethod
    def load(cls, path: str | os.PathLike) -> "Tokenizer":
        """Load ``tokenizer.json`` (a file, or a directory that holds one)."""
        p = Path(path)
        if p.is_dir():
            p = p / "tokenizer.json"
        if not p.is_file():
            raise FileNotFoundError(2, "tokenizer file not found", str(p))
        try:
            hf = _HFTokenizer.from_file(str(p))
        except Exception as e:  # noqa: BLE001 - tokenizers raises a bare Exception for bad JSON
            raise K3Error(f"{p}: not a valid tokenizer file ({str(e).splitlines()[0][:200]})") from None
        return cls(hf)

    def save(self, path: str | os.PathLike) -> Path:
        """Write ``tokenizer.json`` atomically (``path`` a file name or a directory)."""
        p = Path(path)
        if p.is_dir() or not p.suffix:
            p = p / "tokenizer.json"
        text = self.hf.to_str()
        atomic_write(p, lambda f: f.write(text))
        return p

    # --------------------------------------------------------------------------- codec
    @property
    def vocab_size(self) -> int:
        return self.hf.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, allow_special: bool = False) -> list[int]:
        if not allow_special:
            return self.hf.encode(text, add_special_tokens=False).ids
        self.hf.encode_special_tokens = False
        try:
            return self.hf.encode(text, add_special_tokens=False).ids
        finally:
            self.hf.encode_special_tokens = True

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [e.ids for e in self.hf.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=False)

    def token_bytes(self, i: int) -> bytes:
        """The UTF-8 bytes id ``i`` stands for (a special token: its string's bytes).

        Concatenating these for ``encode(s)`` gives ``s.encode()``; streaming decoders feed them to
        an incremental UTF-8 decoder (one BPE token may hold part of a character).
        """
        if self._bytes is None:
            specials = self.hf.get_added_tokens_decoder()
            table = [b""] * self.vocab_size
            for tok, j in self.hf.get_vocab(with_added_tokens=True).items():
                table[j] = (tok.encode("utf-8") if j in specials
                            else bytes(_CHAR_TO_BYTE[c] for c in tok))
            self._bytes = table
        if not 0 <= i < len(self._bytes):
            raise K3Error(f"token id {i} is outside the tokenizer's {len(self._bytes)} ids")
        return self._bytes[i]

    def token_to_id(self, token: str) -> int | None:
        return self.hf.token_to_id(token)

    def id_to_token(self, i: int) -> str | None:
        return self.hf.id_to_token(i)

    @property
    def fingerprint(self) -> str:
        return hashlib.sha256(self.hf.to_str().encode("utf-8")).hexdigest()


def train_tokenizer(texts: Iterable[str], vocab_size: int,
                    special_tokens: Sequence[str] = SPECIAL_TOKENS) -> Tokenizer:
    """Train a byte-level BPE with at most ``vocab_size`` ids (specials included) on ``texts``.

    Exactly ``vocab_size`` unless the text runs out of pairs seen twice; a model may have more
    embedding rows than the tokenizer has ids.
    """
    special_tokens = list(special_tokens)
    if not special_tokens or special_tokens[0] != EOS_TOKEN:
        raise ValueError(f"special_tokens must start with {EOS_TOKEN} (id 0)")
    if vocab_size < 256 + len(special_tokens):
        raise ValueError(f"vocab_size must be >= 256 + {len(special_tokens)} special tokens, "
                         f"got {vocab_size}")
    hf = _HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special_tokens,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  min_frequency=2, show_progress=False)
    hf.train_from_iterator(texts, trainer=trainer)
    return Tokenizer(hf)


def get_tokenizer(corpus: Corpus, vocab_size: int, special_tokens: Sequence[str] = SPECIAL_TOKENS,
                  cache: str | os.PathLike | None = None, verbose: bool = False) -> Tokenizer:
    """The tokenizer for (corpus, vocab_size): from the cache, else trained on the train split."""
    key = hashlib.sha256(
        f"{_FORMAT_VERSION}\0{corpus.fingerprint}\0{vocab_size}\0{chr(0).join(special_tokens)}"
        .encode("utf-8")).hexdigest()[:24]
    path = (Path(cache) if cache is not None else cache_dir("tokenizers")) / key / "tokenizer.json"
    if path.is_file():
        try:
            return Tokenizer.load(path)
        except K3Error as e:
            warnings.warn(f"cached tokenizer unusable, retraining it: {e}", stacklevel=2)
    t0 = time.perf_counter()
    tok = train_tokenizer(corpus.documents("train"), vocab_size, special_tokens)
    if verbose:
        print(f"trained a {vocab_size}-token BPE on {corpus.name} in "
              f"{time.perf_counter() - t0:.1f} s -> {path}")
    tok.save(path)
    return tok
