"""Long-context evaluation primitives of ``k3 eval`` (SPEC §11): *accept* and *retrieve*.

**retrieve** asks whether a model can read back a fact from a long prompt. ``make_retrieval``
builds a synthetic item, deterministic from its arguments (no data, no network)::

    <HEADER>\\n\\n<haystack>\\n\\nQuestion: what is the secret code of <key>? Answer: the secret code of <key> is

The haystack is filler sentences of common lowercase English words (no digits, never the words
"secret" or "code") with fact sentences ``The secret code of <Key> is <5 digits>.`` inserted at
sentence boundaries. ``needle``: one fact, at relative character position ``depth`` of the
haystack. ``multikey``: ``n_keys`` facts with distinct keys and distinct values, the queried one
(picked by the seed) at ``depth``, the others at seeded random depths. A filler sentence can never
look like a fact (no digits), so the queried key has exactly one fact. For one ``seed`` the keys,
values and filler stream do not depend on ``length`` or ``depth``: only the cut and the placement
move. ``solve`` reads the answer off a prompt by itself (the exact solver: a correct model's
ceiling), ``score_answer`` grades a continuation, ``retrieve`` runs a model greedily on items.

**accept** asks whether a model runs at context length T at all, and at what cost: one prefill of
T seeded random ids through a ``K3Cache`` (chunked like the engine's prefill), then greedy decode
steps, with timings, cache bytes and peak resident memory per T.

``training_document`` and ``RetrievalBatches`` are the other side: the documents and training rows
a model learns retrieval from (``benchmarks/hybrid_retrieval.py``).
"""

from __future__ import annotations

import random
import re
import string
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn

from k3.data.packing import IGNORE_INDEX
from k3.data.tokenizer import Tokenizer
from k3.errors import K3Error
from k3.infer.generate import generate
from k3.model.cache import KDAState, MLAState

__all__ = ["RetrievalItem", "make_retrieval", "training_document", "RetrievalBatches", "length_tolerance", "solve",
           "score_answer", "retrieve", "accept", "KINDS"]

KINDS = ("needle", "multikey")
HEADER = "Below is a long text with some facts hidden in it. Read it, then answer the question at the end."
_FACT = "The secret code of {key} is {value}."
_QUESTION = "Question: what is the secret code of {key}? Answer: the secret code of {key} is"
# Filler vocabulary: lowercase, at most 9 letters, none of "secret" / "code" / "question" / "answer".
FILLER_WORDS = tuple("""
the a an and or but of to in on at by for with from about over under after before between
day night year time people world house water river city road garden window table paper music
story family friend teacher child animal tree flower stone cloud morning evening winter summer
small large quiet bright warm cold early late green blue happy simple old young long short
walk run read write sing build carry open close watch listen think learn travel rest cook
often always never slowly quickly together again soon later here there very almost every
village market bridge forest mountain field letter picture kitchen school station harbor
""".split())
_SYLLABLES = ("ka", "lo", "mi", "ren", "tor", "vax", "zel", "quin", "dar", "bel", "sor", "nim",
              "fen", "gal", "hur", "jas", "pel", "rou", "tis", "wen")


def length_tolerance(length: int) -> int:
    """How far below ``length`` a prompt may fall: ``max(12, length // 100)`` tokens.

    ``make_retrieval`` guarantees ``length - length_tolerance(length) <= tokens <= length``
    (and raises K3Error otherwise): the filler is cut word by word at the largest count that fits.
    """
    return max(12, length // 100)


@dataclass
class RetrievalItem:
    """One retrieval prompt. ``length`` is the requested token count, ``tokens`` the actual one
    (``len(prompt_ids)``); ``depth`` the queried fact's relative position in the haystack (0 = its
    start, 1 = its end); ``query`` the key asked about; ``answer`` the exact value string;
    ``keys`` / ``values`` every fact's key and value (multikey: all of them)."""

    kind: str
    length: int
    tokens: int
    depth: float
    seed: int
    n_keys: int
    prompt: str = field(repr=False)
    prompt_ids: list[int] = field(repr=False)
    query: str
    answer: str
    keys: list[str] = field(default_factory=list)
    values: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        """The metadata of a result row: everything but the prompt text and its ids (both are
        rebuilt from kind, length, depth, seed, n_keys and the tokenizer)."""
        d = asdict(self)
        del d["prompt"], d["prompt_ids"]
        return d


def _check_int(name: str, v, lo: int) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise K3Error(f"{name} must be an int >= {lo}, got {v!r}")


def _names(rng: random.Random, n: int) -> list[str]:
    """``n`` distinct capitalized made-up names (2-3 syllables), none a filler word."""
    out: list[str] = []
    while len(out) < n:
        name = "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(2, 3))).capitalize()
        if name not in out and name.lower() not in FILLER_WORDS:
            out.append(name)
    return out


def _filler_sentences(rng: random.Random, n_words: int) -> list[list[str]]:
    """Sentences (6-12 words each) until they hold at least ``n_words`` words."""
    out, total = [], 0
    while total < n_words:
        words = [rng.choice(FILLER_WORDS) for _ in range(rng.randint(6, 12))]
        out.append(words)
        total += len(words)
    return out


def _cut(sentences: list[list[str]], n: int) -> list[str]:
    """The first ``n`` filler words as sentences (the last one cut short keeps its full stop)."""
    out = []
    for words in sentences:
        if n <= 0:
            break
        part = words[:n]
        n -= len(part)
        out.append(" ".join(part).capitalize() + ".")
    return out


def _place(filler: list[str], facts: list[tuple[str, float]], first: int) -> str:
    """Insert fact sentences at the sentence boundaries nearest their depth (relative char offset
    of the filler). ``facts[first]`` is the queried fact: at a shared boundary it goes first when
    its depth is <= 0.5, else last, so depth 0 / 1 put it at the very start / end."""
    offsets = [0]
    for s in filler:
        offsets.append(offsets[-1] + len(s) + 1)
    total = max(offsets[-1] - 1, 0)
    at: dict[int, list[str]] = {}
    for i, (fact, depth) in enumerate(facts):
        if i == first:
            continue
        b = min(range(len(offsets)), key=lambda j: abs(offsets[j] - depth * total))
        at.setdefault(b, []).append(fact)
    fact, depth = facts[first]
    b = min(range(len(offsets)), key=lambda j: abs(offsets[j] - depth * total))
    group = at.setdefault(b, [])
    group.insert(0, fact) if depth <= 0.5 else group.append(fact)
    out: list[str] = []
    for j in range(len(filler) + 1):
        out.extend(at.get(j, ()))
        if j < len(filler):
            out.append(filler[j])
    return " ".join(out)


def make_retrieval(kind: str, tokenizer: Tokenizer, length: int, depth: float, seed: int,
                   n_keys: int | None = None) -> RetrievalItem:
    """A retrieval item of ``kind`` ("needle" | "multikey") whose prompt is close to ``length``
    tokens: ``length - length_tolerance(length) <= tokens <= length`` (``tokens`` counts
    ``tokenizer.encode(prompt)``; ``tokenizer`` is anything with ``encode(str) -> list[int]``).

    ``depth`` in [0, 1] places the queried fact; ``n_keys`` is 1 for a needle (the default) and
    the number of facts for multikey (default 4, at least 2). Deterministic in all arguments.
    K3Error when ``length`` cannot hold the header, the facts and the question.
    """
    if kind not in KINDS:
        raise K3Error(f"kind must be one of {KINDS}, got {kind!r}")
    _check_int("length", length, 1)
    _check_int("seed", seed, 0)
    if isinstance(depth, bool) or not isinstance(depth, (int, float)) or not 0.0 <= depth <= 1.0:
        raise K3Error(f"depth must be a number in [0, 1], got {depth!r}")
    if n_keys is None:
        n_keys = 1 if kind == "needle" else 4
    if kind == "needle" and n_keys != 1:
        raise K3Error(f"a needle item has one key, got n_keys={n_keys!r}")
    _check_int("n_keys", n_keys, 1 if kind == "needle" else 2)
    if n_keys > 1000:
        raise K3Error(f"n_keys must be <= 1000, got {n_keys}")

    rng = random.Random(f"k3-longctx-keys-{seed}")
    keys = _names(rng, n_keys)
    values = [str(v) for v in rng.sample(range(10000, 100000), n_keys)]
    first = rng.randrange(n_keys)
    facts = [(_FACT.format(key=k, value=v), float(depth) if i == first else rng.random())
             for i, (k, v) in enumerate(zip(keys, values, strict=True))]
    # every word costs at least one token, so `length` words always overshoot
    sentences = _filler_sentences(random.Random(f"k3-longctx-filler-{seed}"), length)
    tail = "\n\n" + _QUESTION.format(key=keys[first])

    def build(n: int) -> tuple[str, list[int]]:
        prompt = HEADER + "\n\n" + _place(_cut(sentences, n), facts, first) + tail
        return prompt, tokenizer.encode(prompt)

    prompt, ids = build(0)
    if len(ids) > length:
        raise K3Error(f"length={length} is too short for a {kind} item: the header, {n_keys} fact(s) "
                      f"and the question alone take {len(ids)} tokens")
    lo, hi = 0, sum(len(s) for s in sentences)   # build(lo) fits; find the most words that fit
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if len(build(mid)[1]) <= length:
            lo = mid
        else:
            hi = mid - 1
    prompt, ids = build(lo)
    if not length - length_tolerance(length) <= len(ids) <= length:
        raise K3Error(f"could not fit a {kind} prompt to {length} tokens (got {len(ids)}, tolerance "
                      f"{length_tolerance(length)}): the tokenizer does not count filler words additively")
    return RetrievalItem(kind=kind, length=length, tokens=len(ids), depth=float(depth), seed=seed,
                         n_keys=n_keys, prompt=prompt, prompt_ids=ids, query=keys[first],
                         answer=values[first], keys=keys, values=values)


def training_document(seed: int, words: int, n_keys: int) -> str:
    """A document to train retrieval on, in the evaluation items' sentence format: the header, a
    haystack of ``words`` filler words with ``n_keys`` facts at random depths, then one answered
    question per fact in random order ("Question: … Answer: the secret code of <key> is <value>."
    on its own line), so a model learns to finish an item's last line. Keys and values come from
    their own random stream (``k3-longctx-train-…``), never the evaluation items' (``make_retrieval``
    seeds its keys with ``k3-longctx-keys-…``)."""
    _check_int("seed", seed, 0)
    _check_int("words", words, 0)
    _check_int("n_keys", n_keys, 1)
    rng = random.Random(f"k3-longctx-train-{seed}")
    keys = _names(rng, n_keys)
    values = [str(v) for v in rng.sample(range(10000, 100000), n_keys)]
    facts = [(_FACT.format(key=k, value=v), rng.random()) for k, v in zip(keys, values, strict=True)]
    filler = _cut(_filler_sentences(rng, words), words)
    order = rng.sample(range(n_keys), n_keys)
    qa = "\n".join(_QUESTION.format(key=keys[i]) + f" {values[i]}." for i in order)
    return HEADER + "\n\n" + _place(filler, facts, 0) + "\n\n" + qa + "\n"


class RetrievalBatches:
    """Training rows for a retrieval model: an in-memory batch source for ``Trainer(batches=)``.

    Each row is one whole ``training_document`` (document seeds 0, 1, 2, … in order; the cursor
    is the resumable state), its filler cut so that the document takes a token count drawn
    uniformly from ``[min_tokens, seq_len + 1]``: facts sit at every distance up to the training
    length, and no question is ever cut off from its fact (strided windows over a token stream
    would do that). The loss is on the answered questions only: the targets are the document's
    next tokens from the first "Question:" on and ``IGNORE_INDEX`` before it (the haystack) and in
    the padding after the document (token 0). Each document holds ``n_keys`` facts, or with
    ``min_keys`` a count drawn from ``[min_keys, n_keys]`` (one-fact documents teach the copy before
    the key matters). ``tokenizer`` is the one the ids come from: the trainer saves it with each
    checkpoint, so the run evaluates like any other."""

    def __init__(self, tokenizer: Tokenizer, batch_size: int, n_keys: int, seed: int = 0, min_tokens: int = 0,
                 min_keys: int | None = None):
        _check_int("batch_size", batch_size, 1)
        _check_int("n_keys", n_keys, 1)
        _check_int("seed", seed, 0)
        _check_int("min_tokens", min_tokens, 0)
        min_keys = n_keys if min_keys is None else min_keys
        _check_int("min_keys", min_keys, 1)
        if min_keys > n_keys:
            raise K3Error(f"min_keys={min_keys} is more than n_keys={n_keys}")
        self.tokenizer, self.batch_size, self.n_keys, self.min_keys, self.seed, self.min_tokens = (
            tokenizer, batch_size, n_keys, min_keys, seed, min_tokens)
        self.next_doc = 0
        self.fingerprint = (f"retrieval-documents/keys={min_keys}-{n_keys}/seed={seed}/min={min_tokens}/"
                            f"tokenizer={tokenizer.fingerprint[:16]}")

    def keys_of(self, i: int) -> int:
        """How many facts document ``i`` holds: drawn uniformly from ``[min_keys, n_keys]``."""
        return random.Random(f"k3-longctx-keys-of-{self.seed}-{i}").randint(self.min_keys, self.n_keys)

    def _build(self, i: int, words: int) -> tuple[list[int], int]:
        text = training_document(self.seed * 1_000_000_007 + i, words, self.keys_of(i))
        cut = text.index("\n\nQuestion:") + 2
        ids, head = self.tokenizer.encode(text), self.tokenizer.encode(text[:cut])
        if ids[:len(head)] != head:
            raise K3Error("the tokenizer merges across the blank line before the questions")
        return ids, len(head)

    def document(self, i: int, seq_len: int) -> tuple[list[int], int]:
        """Document ``i`` for rows of ``seq_len`` tokens: its ids (at most ``seq_len + 1``) and the
        index of its first question token. K3Error when even no filler is too long."""
        best = self._build(i, 0)
        if len(best[0]) > seq_len + 1:
            raise K3Error(f"a retrieval document with {self.keys_of(i)} facts takes {len(best[0])} tokens "
                          f"without filler: more than rows of {seq_len} hold")
        rng = random.Random(f"k3-longctx-rows-{self.seed}-{i}")
        budget = rng.randint(min(max(len(best[0]), self.min_tokens), seq_len + 1), seq_len + 1)
        lo, hi = 0, budget   # every filler word costs at least one token: the most that fit
        while lo < hi:
            mid = (lo + hi + 1) // 2
            doc = self._build(i, mid)
            if len(doc[0]) <= budget:
                lo, best = mid, doc
            else:
                hi = mid - 1
        return best

    def next_batch(self, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.zeros(self.batch_size, seq_len, dtype=torch.long)
        y = torch.full((self.batch_size, seq_len), IGNORE_INDEX, dtype=torch.long)
        for row in range(self.batch_size):
            ids, q = self.document(self.next_doc, seq_len)
            n = len(ids) - 1
            x[row, :n] = torch.tensor(ids[:-1])
            y[row, q - 1:n] = torch.tensor(ids[q:])
            self.next_doc += 1
        return x, y

    def state_dict(self) -> dict:
        return {"next_doc": self.next_doc}

    def load_state_dict(self, state: dict) -> None:
        self.next_doc = int(state["next_doc"])


_Q_RE = re.compile(r"Question: what is the secret code of (\S+?)\?")


def solve(prompt: str) -> str:
    """The exact answer of a retrieval prompt, read off its text: the key named in the last
    "Question: what is the secret code of <key>?" and the digits of the one sentence
    "secret code of <key> is <digits>." before that question. K3Error when there is no
    question, or the key has no fact sentence, or more than one."""
    questions = list(_Q_RE.finditer(prompt))
    if not questions:
        raise K3Error("no 'Question: what is the secret code of <key>?' in the prompt")
    q = questions[-1]
    key = q.group(1)
    found = re.findall(rf"\bsecret code of {re.escape(key)} is (\d+)\.", prompt[: q.start()])
    if len(found) != 1:
        raise K3Error(f"key {key!r} has {len(found)} fact sentences before the question (want exactly 1)")
    return found[0]


def score_answer(generated_text: str, answer: str) -> bool:
    """Exact match: the first whitespace-delimited word of ``generated_text`` (stripped), with
    trailing punctuation removed, equals ``answer`` (stripped). An empty continuation is wrong."""
    words = generated_text.strip().split()
    return bool(words) and words[0].rstrip(string.punctuation) == answer.strip()


def _device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


def retrieve(model: nn.Module, tokenizer: Tokenizer, items: Iterable[RetrievalItem],
             max_new_tokens: int = 8) -> list[dict]:
    """Greedy continuation of every item's ``prompt_ids`` (``k3.infer.generate.generate``,
    temperature 0, no EOS stop) by ``max_new_tokens`` tokens, scored with ``score_answer``.

    Row per item: ``item.as_dict()`` plus ``output`` (the decoded new tokens), ``correct`` and
    ``seconds`` (wall time of that item's generate call: engine start, prefill and decode).
    K3Error, before anything runs, when a prompt plus ``max_new_tokens`` exceeds the model's
    ``config.max_position_embeddings``.
    """
    items = list(items)
    _check_int("max_new_tokens", max_new_tokens, 1)
    max_pos = model.config.max_position_embeddings
    for it in items:
        if len(it.prompt_ids) + max_new_tokens > max_pos:
            raise K3Error(f"{it.kind} item of {len(it.prompt_ids)} prompt tokens + max_new_tokens="
                          f"{max_new_tokens} exceeds the model's max_position_embeddings={max_pos}")
    dev = _device(model)
    rows = []
    for it in items:
        t0 = time.perf_counter()
        out = generate(model, torch.tensor(it.prompt_ids, dtype=torch.long, device=dev), max_new_tokens,
                       temperature=0.0)
        seconds = time.perf_counter() - t0
        text = tokenizer.decode(out[len(it.prompt_ids):].tolist())
        rows.append({**it.as_dict(), "output": text, "correct": score_answer(text, it.answer),
                     "seconds": seconds})
    return rows


def _status_bytes(key: str) -> int | None:
    """``VmHWM`` / ``VmRSS`` of /proc/self/status in bytes, None where unreadable."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _reset_peak_rss() -> str | None:
    """Reset this process's peak RSS to its current RSS; the reason when that is impossible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError as e:
        return f"peak RSS not measured: /proc/self/clear_refs is not writable ({type(e).__name__}: {e})"
    return None


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


@torch.no_grad()
def _accept_one(model: nn.Module, T: int, decode_tokens: int, seed: int, prefill_chunk: int) -> dict:
    cfg = model.config
    if T + decode_tokens > cfg.max_position_embeddings:
        raise K3Error(f"T={T} + decode_tokens={decode_tokens} exceeds max_position_embeddings="
                      f"{cfg.max_position_embeddings}")
    dev = _device(model)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (1, T), generator=g).to(dev)
    note = _reset_peak_rss()
    row: dict = {"rss_before_bytes": _status_bytes("VmRSS")}
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    cache = model.new_cache(1)
    _sync(dev)
    t0 = time.perf_counter()
    for s in range(0, T, prefill_chunk):
        logits = model(ids[:, s: s + prefill_chunk], cache=cache, logits_to_keep=1).logits[:, -1]
    _sync(dev)
    prefill_s = time.perf_counter() - t0
    kda = sum(st.nbytes() for st in cache.layers if isinstance(st, KDAState))
    mla = sum(st.nbytes() for st in cache.layers if isinstance(st, MLAState))
    t1 = time.perf_counter()
    for _ in range(decode_tokens):
        logits = model(logits.argmax(-1, keepdim=True), cache=cache, logits_to_keep=1).logits[:, -1]
    _sync(dev)
    decode_s = time.perf_counter() - t1
    if not torch.isfinite(logits).all():
        raise K3Error(f"non-finite logits at T={T}")
    row.update(prefill_seconds=prefill_s, prefill_s_per_token=prefill_s / T, decode_tokens=decode_tokens,
               decode_seconds=decode_s, decode_s_per_token=decode_s / decode_tokens if decode_tokens else None,
               cache_bytes=kda + mla, cache_kda_bytes=kda, cache_mla_bytes=mla,
               peak_rss_bytes=None if note else _status_bytes("VmHWM"))
    if note or row["peak_rss_bytes"] is None:
        row["peak_note"] = note or "peak RSS not measured: no VmHWM in /proc/self/status"
    if dev.type == "cuda":
        row["peak_cuda_bytes"] = torch.cuda.max_memory_allocated(dev)
    return row


@torch.no_grad()
def _warm_up(model: nn.Module) -> None:
    """A 16-token prefill and one decode step, untimed; a failure here is left to the rows."""
    ids = torch.zeros(1, 17, dtype=torch.long, device=_device(model))
    try:
        cache = model.new_cache(1)
        model(ids[:, :16], cache=cache, logits_to_keep=1)
        model(ids[:, 16:], cache=cache, logits_to_keep=1)
    except (RuntimeError, ValueError, MemoryError):
        pass


def accept(model: nn.Module, lengths: Sequence[int], decode_tokens: int = 16, seed: int = 0,
           prefill_chunk: int = 512) -> list[dict]:
    """Does ``model`` run at each context length T of ``lengths``, and at what cost?

    Per T: a fresh batch-1 ``K3Cache``; prefill of T random ids (``torch.Generator`` seeded with
    ``seed``, uniform over the model's vocabulary) as forwards of ``prefill_chunk`` tokens (the
    engine's default chunk: chunk KDA, MLA over the latent KV); then ``decode_tokens`` greedy steps
    of one token each (the argmax of the previous logits) through that cache. Before the first T an
    untimed 16-token prefill and one decode step run once, so one-time costs (kernel builds, first
    allocations) do not land in the first row. A success row holds:

    * ``length`` (T), ``ok``: True, ``decode_tokens``;
    * ``prefill_seconds`` (wall time of all prefill forwards) and ``prefill_s_per_token`` (/ T);
    * ``decode_seconds`` (wall time of the decode steps) and ``decode_s_per_token`` (/ decode_tokens,
      the mean step; None when decode_tokens is 0);
    * ``cache_bytes`` = ``cache_kda_bytes`` + ``cache_mla_bytes`` right after prefill: the bytes of
      the KDA conv + recurrent states and of the T cached MLA latent tokens (``c_kv`` + ``k_pe``;
      spare buffer capacity not counted), i.e. ``K3Cache.nbytes()``;
    * ``rss_before_bytes``: resident memory when the peak was reset (the model already loaded);
      ``peak_rss_bytes``: the process's peak resident memory (``VmHWM``) over this T's prefill and
      decode, the peak having been reset to the current RSS by writing 5 to
      /proc/self/clear_refs before it; None with a ``peak_note`` saying why where that file is not
      writable; ``peak_cuda_bytes`` (the allocator's peak) when the model is on a GPU.

    A failure at one T (too long for ``config.max_position_embeddings`` with the decode steps, out
    of memory, non-finite logits, any RuntimeError / ValueError / MemoryError) gives ``{"length": T, "ok": False,
    "error": "<Type>: <first line>"}`` and the next T runs. The model's train/eval mode is restored.
    """
    lengths = list(lengths)
    for T in lengths:
        _check_int("each length", T, 1)
    _check_int("decode_tokens", decode_tokens, 0)
    _check_int("seed", seed, 0)
    _check_int("prefill_chunk", prefill_chunk, 1)
    was_training = model.training
    model.eval()
    rows = []
    try:
        _warm_up(model)
        for T in lengths:
            try:
                rows.append({"length": T, "ok": True, **_accept_one(model, T, decode_tokens, seed, prefill_chunk)})
            except (RuntimeError, ValueError, MemoryError) as e:
                msg = (str(e).strip().splitlines() or [""])[0][:300]
                rows.append({"length": T, "ok": False, "error": f"{type(e).__name__}: {msg}"})
                if _device(model).type == "cuda":
                    torch.cuda.empty_cache()
    finally:
        model.train(was_training)
    return rows
