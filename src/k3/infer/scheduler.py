"""Scheduling of the engine (SPEC §6.1): requests, their handles, admission, the prefill plan of
each step and the decode groups. Nothing here runs a model: ``Scheduler.schedule()`` returns a
``StepPlan`` that ``k3.infer.runner.ModelRunner`` executes, and it is tested without a model.

Life of a request: ``waiting`` → (admitted while fewer than ``max_batch`` are active and the byte
budget holds its worst case) ``prefill`` (chunks of the prompt through a batch-1 cache) →
``running`` (one decode step per engine step, inside a ``DecodeGroup``) → finished. A decode group
is one batched ``K3Cache`` and its requests in row order. With per-sequence cache lengths
(``K3Cache.seq_lens``) every running request shares one group; without them a group holds
requests of equal length only (they stay equal: each step adds one token to every row).

One step's plan: admit waiting requests (up to ``max_batch`` active, each reserving its worst-case
cache bytes within ``max_cache_bytes``), then spend at most ``prefill_chunk`` prompt tokens on the
prefilling requests, oldest first: a ``PrefillBatch`` of equal-length whole prompts that miss the
prefix cache (one [k, n] forward, no padding), or ``PrefillChunk``s of one request, cut at every
``cache_block`` boundary when the prefix cache is on (each boundary is snapshotted). Then every
running request decodes one token. A request that has not consulted the prefix cache yet is
planned from ``prefix.peek`` (what its lookup would give now); one that could hit a snapshot an
earlier item of the same plan will insert waits for the next step, so planning before running
loses no prefix hit.

Everything here is touched by the engine thread only (the waiting queue under the engine's lock),
except ``RequestHandle`` (any thread).
"""

from __future__ import annotations

import collections
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from k3.model.cache import K3Cache

__all__ = ["TokenEvent", "Completion", "RequestHandle", "Request", "DecodeGroup", "per_row_lengths",
           "PrefillChunk", "PrefillBatch", "StepPlan", "Scheduler"]

_END = object()


@dataclass(frozen=True)
class TokenEvent:
    """One generated token. ``finish_reason`` is None until the last event ("stop", "length",
    "cancelled"); ``text_delta`` is the new text (stop strings and held-back text excluded)."""

    token_id: int | None
    text_delta: str
    logprob: float | None
    finish_reason: str | None = None
    top_logprobs: list[tuple[int, float]] | None = None


@dataclass
class Completion:
    token_ids: list[int]
    text: str
    finish_reason: str | None
    logprobs: list[float | None] = field(default_factory=list)
    prompt_logprobs: list | None = None   # with SamplingParams.prompt_logprobs (RequestHandle's)


class RequestHandle:
    """Iterate for ``TokenEvent``s (blocking); a failed request raises its error from iteration
    and from ``result()``. ``cancel()`` stops it; its slot and cache are freed before the next step."""

    def __init__(self, rid: int, engine):
        self.rid = rid
        self._engine = engine
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self.error: BaseException | None = None
        self.finish_reason: str | None = None
        self.done = False
        self.events: list[TokenEvent] = []  # every event handed out so far
        # with SamplingParams.prompt_logprobs: [None] + per prompt token after the first (its logprob,
        # [(id, logprob)] top alternatives); set by the engine before the request's first event
        self.prompt_logprobs: list | None = None
        self._ended = threading.Event()     # set with the end marker: result() waits on it alone

    def _put(self, ev: TokenEvent) -> None:
        self._q.put(ev)

    def _fail(self, err: BaseException) -> None:
        self.error = err
        self._q.put(_END)
        self._ended.set()

    def _close(self) -> None:
        self._q.put(_END)
        self._ended.set()

    def cancel(self) -> None:
        self._engine._cancel(self)

    def _take(self, ev) -> bool:
        """Record one queue item; False at the end marker."""
        if ev is _END:
            self.done = True
            return False
        if ev.finish_reason is not None:
            self.finish_reason = ev.finish_reason
        self.events.append(ev)
        return True

    def __iter__(self):
        while not self.done:  # a handle already read to its end yields nothing more
            ev = self._q.get()
            if not self._take(ev):
                break
            yield ev
        if self.error is not None:
            raise self.error

    def pending(self) -> bool:
        """Whether ``poll`` would return something new (an event or the end)."""
        return not self.done and not self._q.empty()

    def poll(self) -> list[TokenEvent]:
        """The events available now, without blocking (for an event loop woken by
        ``Engine.add_listener``); once the end was read ``done`` is True (and ``error`` set for a
        failed request: the caller raises it, as iteration does)."""
        out = []
        while not self.done:
            try:
                ev = self._q.get_nowait()
            except queue.Empty:
                break
            if self._take(ev):
                out.append(ev)
        return out

    def result(self) -> Completion:
        """Block until the request ends; all its tokens, text and finish reason (also those events
        already read by iterating). It sleeps until the end rather than waking for every token, so
        a waiting caller takes no CPU from the engine's step (b1 decode: 72.5 -> 87.8 tokens/s)."""
        self._ended.wait()
        for _ in self:   # everything is queued now: drains without blocking
            pass
        ids, text, lps, reason = [], [], [], None
        for ev in self.events:
            if ev.token_id is not None:
                ids.append(ev.token_id)
                lps.append(ev.logprob)
            text.append(ev.text_delta)
            reason = ev.finish_reason or reason
        return Completion(ids, "".join(text), reason, lps, self.prompt_logprobs)


@dataclass
class Request:
    handle: RequestHandle
    prompt: list[int]
    params: Any            # SamplingParams
    sampler: Any           # Sampler
    stream: Any            # TextStream
    reserved: int          # bytes of cache reserved at admission (worst case)
    max_tokens: int        # params.max_tokens capped by max_position_embeddings
    cache: K3Cache | None = None
    pos: int = 0           # prompt tokens already in the cache
    started: bool = False  # the prefix cache was consulted (a miss leaves ``cache`` None, ``pos`` 0)
    solo: bool = False     # prefilled alone (a batched prefill that held it failed; prompt logprobs)
    prompt_lps: list | None = None   # prompt logprobs so far (SamplingParams.prompt_logprobs)
    images: Any = None     # k3.infer.media.PromptImages of a prompt with images (prefilled solo)
    _key: list[int] | None = None
    out: list[int] = field(default_factory=list)
    finished: bool = False  # ended (stop, length, cancel, error): its rows are dropped
    t_submit: float = field(default_factory=time.perf_counter)
    t_first: float | None = None

    @property
    def cache_key(self) -> list[int]:
        """What the prefix cache keys this prompt by: its ids, images by content (k3.infer.media)."""
        if self.images is None:
            return self.prompt
        if self._key is None:
            self._key = self.images.key(self.prompt)
        return self._key


def per_row_lengths(cache: K3Cache) -> bool:
    """Whether this cache type batches sequences of different lengths (the contract's seq_lens)."""
    return hasattr(cache, "seq_lens")


class DecodeGroup:
    """Running requests decoded together: ``cache`` row ``i`` belongs to ``reqs[i]``."""

    def __init__(self, reqs: list[Request], cache: K3Cache):
        """A group of ``reqs`` whose rows are ``cache`` (in order)."""
        self.reqs, self.cache = list(reqs), cache

    def length(self) -> int:
        return self.cache.seq_len

    def accepts(self, cache: K3Cache) -> bool:
        """Whether rows ``cache`` can join (per-row lengths, or the same length as the group's)."""
        return per_row_lengths(self.cache) or self.cache.seq_len == cache.seq_len

    def join(self, reqs: list[Request], cache: K3Cache) -> None:
        """Append ``reqs`` whose rows are ``cache`` (in order), with one concatenation."""
        self.cache = K3Cache.cat([self.cache, cache])
        self.reqs.extend(reqs)

    def drop(self, gone: set[int]) -> None:
        """Remove the rows of requests whose handle ids are in ``gone``; keeps the others' order."""
        keep = [i for i, r in enumerate(self.reqs) if r.handle.rid not in gone]
        if len(keep) == len(self.reqs):
            return
        self.reqs = [self.reqs[i] for i in keep]
        self.cache = self.cache.select(torch.tensor(keep)) if keep else None

    def last_tokens(self, device) -> torch.Tensor:
        return torch.tensor([[r.out[-1]] for r in self.reqs], dtype=torch.long, device=device)


@dataclass
class PrefillChunk:
    """Run ``req``'s prompt up to token ``end`` (from ``start``, where the plan expects it to be)."""
    req: Request
    start: int
    end: int


@dataclass
class PrefillBatch:
    """The whole prompts of ``reqs`` (equal length, prefix-cache misses) as one [k, n] forward."""
    reqs: list[Request]


@dataclass
class StepPlan:
    """One engine step: ``admitted`` moved from waiting to prefill, the ``prefill`` work in order,
    then one decode step of every running group (those that finish prefilling in this step
    included: they decode their second token in it)."""
    admitted: list[Request]
    prefill: list[PrefillChunk | PrefillBatch]

    def prompt_tokens(self) -> int:
        """Prompt tokens the plan runs (as planned)."""
        return sum(len(w.reqs) * len(w.reqs[0].prompt) if isinstance(w, PrefillBatch) else w.end - w.start
                   for w in self.prefill)


class Scheduler:
    """``Scheduler(max_batch, prefill_chunk, cache_block, max_cache_bytes=None, prefix=None)``.

    ``prefix``: the prefix cache (anything with ``peek(tokens) -> int``), or None. The engine
    ``add``s requests, calls ``schedule()`` once per step, and reports back: ``prefilled`` (a
    request's prompt is in its cache rows: it joins a decode group), ``remove_prefill`` (a failed
    prefill) and ``drop_finished`` (finished requests leave their groups)."""

    def __init__(self, max_batch: int, prefill_chunk: int, cache_block: int, max_cache_bytes: int | None = None,
                 prefix=None):
        self.max_batch, self.prefill_chunk, self.cache_block = max_batch, prefill_chunk, cache_block
        self.max_cache_bytes, self.prefix = max_cache_bytes, prefix
        self.waiting: collections.deque[Request] = collections.deque()
        self.prefilling: list[Request] = []
        self.groups: list[DecodeGroup] = []

    # ---------------------------------------------------------------- the queues
    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.prefilling or self.groups)

    def num_active(self) -> int:
        return len(self.prefilling) + sum(len(g.reqs) for g in self.groups)

    def requests(self) -> list[Request]:
        """Every request the scheduler holds: waiting, prefilling, running."""
        return [*self.waiting, *self.prefilling, *(r for g in self.groups for r in g.reqs)]

    def clear(self) -> None:
        self.waiting.clear(), self.prefilling.clear(), self.groups.clear()

    def remove_waiting(self, handle) -> Request | None:
        """Take the waiting request of ``handle`` out of the queue (None: it is not waiting)."""
        for r in self.waiting:
            if r.handle is handle:
                self.waiting.remove(r)
                return r
        return None

    def cancel(self, rids: set[int]) -> list[Request]:
        """The admitted requests whose handle ids are in ``rids`` (unfinished ones); those still
        prefilling leave the prefill list with their cache. The caller ends them, then
        ``drop_finished()`` frees the rows of the running ones."""
        out = [r for r in self.prefilling if r.handle.rid in rids]
        for r in out:
            self.prefilling.remove(r)
            r.cache = None
        return out + [r for g in self.groups for r in g.reqs if r.handle.rid in rids and not r.finished]

    def remove_prefill(self, req: Request) -> None:
        """``req`` leaves prefill without joining a decode group (it failed or finished at once)."""
        self.prefilling.remove(req)
        req.cache = None

    def prefilled(self, reqs: list[Request], rows) -> None:
        """``reqs`` (whole prompts in cache ``rows``, in order) leave prefill; the unfinished ones
        join the first decode group that accepts their rows, or start one."""
        for r in reqs:
            self.prefilling.remove(r)
        keep = [i for i, r in enumerate(reqs) if not r.finished]
        if not keep:
            return
        if len(keep) < len(reqs):
            rows = rows.select(keep)
        reqs = [reqs[i] for i in keep]
        group = next((g for g in self.groups if g.accepts(rows)), None)
        if group is None:
            self.groups.append(DecodeGroup(reqs, rows))
        else:
            group.join(reqs, rows)

    def drop_finished(self) -> None:
        """Finished requests leave their decode groups (their cache rows are dropped)."""
        for g in self.groups:
            g.drop({r.handle.rid for r in g.reqs if r.finished})
        self.groups = [g for g in self.groups if g.reqs]

    # ---------------------------------------------------------------- the plan
    def schedule(self) -> StepPlan:
        """Admit, then plan this step's prefill (see the module docstring)."""
        admitted = self._admit()
        work: list[PrefillChunk | PrefillBatch] = []
        planned: list[Request] = []        # requests with work in this plan (their snapshots go in)
        taken: set[int] = set()            # handle ids already in a batch
        budget = self.prefill_chunk
        for r in self.prefilling:
            if budget <= 0:
                break
            if r.handle.rid in taken:
                continue
            start = self.start_of(r, planned)
            if start is None:              # it may hit a snapshot this plan inserts: next step
                break
            batch = self._batch(r, start, planned, budget)
            if len(batch) > 1:
                work.append(PrefillBatch(batch))
                taken.update(b.handle.rid for b in batch)
                planned.extend(batch)
                budget -= len(batch) * len(r.prompt)
                continue
            n, pos = len(r.prompt), start
            while budget > 0 and pos < n:
                end = self.chunk_end(pos, n, budget)
                work.append(PrefillChunk(r, pos, end))
                budget -= end - pos
                pos = end
            planned.append(r)
        return StepPlan(admitted, work)

    def _admit(self) -> list[Request]:
        active = self.num_active()
        used = sum(r.reserved for r in self.prefilling) + sum(r.reserved for g in self.groups for r in g.reqs)
        admitted = []
        while self.waiting and active < self.max_batch:
            r = self.waiting[0]
            if self.max_cache_bytes is not None and used + r.reserved > self.max_cache_bytes:
                break
            self.waiting.popleft()
            self.prefilling.append(r)
            admitted.append(r)
            active += 1
            used += r.reserved
        return admitted

    def chunk_end(self, pos: int, n: int, budget: int) -> int:
        """End of the next prefill chunk: at most ``budget`` tokens, and with the prefix cache never
        past the next ``cache_block`` boundary (each boundary gets its snapshot)."""
        end = min(pos + budget, n)
        if self.prefix is not None:
            end = min(end, (pos // self.cache_block + 1) * self.cache_block)
        return end

    @staticmethod
    def uses_prefix(req: Request) -> bool:
        """Whether ``req`` looks up the prefix cache (one scoring its prompt runs every position)."""
        return req.params.prompt_logprobs is None

    def start_of(self, req: Request, planned: list[Request] = ()) -> int | None:
        """Where ``req``'s prefill starts: its position once started; before, what its prefix-cache
        lookup gives now (a usable hit covers 1 .. n−1 tokens), or None when a request of this
        plan may insert a snapshot it could resume from."""
        if req.started or req.cache is not None:
            return req.pos
        if self.prefix is None or not self.uses_prefix(req):
            return 0
        if any(self._could_hit(req, q) for q in planned):
            return None
        hit = self.prefix.peek(req.cache_key)
        return hit if 0 < hit < len(req.prompt) else 0

    def _could_hit(self, req: Request, q: Request) -> bool:
        """Whether ``req`` could resume from a snapshot of ``q``'s prompt: they share at least
        ``q``'s shallowest snapshot (a block boundary, or ``q``'s end when shorter)."""
        a, b = req.cache_key, q.cache_key
        first = min(self.cache_block, len(b))
        return first <= len(a) - 1 and a[:first] == b[:first]

    def _batch(self, head: Request, start: int, planned: list[Request], budget: int) -> list[Request]:
        """``head`` and the next prefilling requests with a prompt of its length, when each is a
        fresh prefix-cache miss (``start == 0``, not ``solo``) and its whole prompt is one chunk,
        at most ``budget`` tokens in all. Equal lengths only, so no row is padded (a KDA state
        would absorb the padding). Only whole short prompts: a long prompt keeps its boundary
        snapshots, and two prompts of one length never resume from each other's end snapshot,
        so batching them loses no hit among them."""
        n = len(head.prompt)
        if head.solo or head.cache is not None or start != 0 or self.chunk_end(0, n, budget) != n:
            return [head]
        batch, used = [head], n
        for r in self.prefilling:
            if r is head:
                continue
            if used + n > budget:
                break
            if (len(r.prompt) == n and not r.solo and r.cache is None
                    and all(r is not q for q in planned) and self.start_of(r, planned) == 0):
                batch.append(r)
                used += n
        return batch
