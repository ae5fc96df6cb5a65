"""Prefix cache for a hybrid KDA + MLA model (SPEC §6.2): a radix tree of state snapshots.

The tree is cut at multiples of ``cache_block`` (B). A node at depth ``d`` stands for the prefix
``tokens[:d]`` and holds

* ``kv``: for every MLA layer, the latent KV of *its own* tokens ``tokens[parent.depth:d]``
  (``c`` [n, kv_lora_rank], ``k_pe`` [n, qk_rope_head_dim]); the KV of the whole prefix is the
  concatenation along the root→node path, so memory is linear in the prefix length;
* ``kda`` (optional): for every KDA layer, the conv state [3P, K−1] and recurrent state [nh, d, d]
  after exactly ``tokens[:d]``: the *snapshot*.

Block nodes have a segment of exactly B tokens; a prompt-end node (depth not a multiple of B) is a
leaf whose segment is shorter than B, hanging off the last block node of its prompt.

A prefix can only be resumed where a snapshot exists: MLA KV alone cannot restart a KDA layer
(its state summarises every earlier token), so ``match`` returns the deepest *snapshot* node on
the path, never a deeper KV-only one. ``match`` builds a fresh batch-1 ``K3Cache`` from copies
(concatenation / clone), so a request never holds a tensor the tree keeps (copy-on-write).

Eviction (LRU under ``max_bytes``): the unit is a snapshot, ordered by its last use (insert or
hit). Evicting a leaf's snapshot removes the leaf with its KV (and any ancestors left as leaves
without a snapshot); evicting an internal node's snapshot keeps its KV, which deeper snapshots
need. KV is therefore freed leaves first.
"""

from __future__ import annotations

import heapq
import operator
from dataclasses import dataclass, field
from typing import Sequence

import torch

from k3.errors import K3Error
from k3.model.cache import K3Cache, KDAState, MLAState

__all__ = ["PrefixCache", "PrefixHit"]


def _token_ids(tokens) -> list[int]:
    """``tokens`` as a list of Python ints (dict keys must hash like ints; 0-d tensors do not)."""
    ids = tokens.tolist() if isinstance(tokens, torch.Tensor) else list(tokens)
    if set(map(type, ids)) - {int}:
        try:
            ids = [operator.index(t) for t in ids]
        except TypeError:
            raise K3Error(f"token ids must be integers, got {sorted({type(t).__name__ for t in ids})}") from None
    return ids


def _nbytes(ts) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


@dataclass
class PrefixHit:
    """``length`` tokens of the query are covered by ``cache`` (None on a miss, length 0)."""
    length: int
    cache: K3Cache | None


@dataclass(eq=False)
class _Node:
    depth: int
    parent: "_Node | None"
    kv: list[tuple[torch.Tensor, torch.Tensor]]       # per MLA layer: (c [n, r], k_pe [n, p])
    kda: list[tuple[torch.Tensor, torch.Tensor]] | None = None  # per KDA layer: (conv, recurrent)
    key: tuple[int, ...] = ()
    children: dict[tuple[int, ...], "_Node"] = field(default_factory=dict)
    tail_lengths: set[int] = field(default_factory=set)  # key lengths of prompt-end children
    last_used: int = 0

    @property
    def kv_bytes(self) -> int:
        return _nbytes(t for pair in self.kv for t in pair)

    @property
    def kda_bytes(self) -> int:
        return 0 if self.kda is None else _nbytes(t for pair in self.kda for t in pair)


class PrefixCache:
    """Radix tree of hybrid-state snapshots. ``PrefixCache(cache_block, max_bytes)``.

    * ``insert(tokens, cache)``: ``cache`` is a batch-1 K3Cache that has seen exactly ``tokens``
      (``len(tokens)`` a multiple of ``cache_block``, or a prompt end). Copies what the tree lacks.
    * ``match(tokens) -> PrefixHit``: the deepest snapshot at depth ≤ ``len(tokens) − 1`` (a cache
      carries no logits, so at least one token is always left for the caller to feed).
    * ``peek(tokens) -> int``: the length ``match`` would give now, without counting or copying.
    * ``stats()``: hits, misses, hit_tokens, bytes, entries (snapshots), nodes, evictions.
    """

    def __init__(self, cache_block: int, max_bytes: int):
        for name, v in (("cache_block", cache_block), ("max_bytes", max_bytes)):
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise K3Error(f"PrefixCache: {name} must be an int > 0, got {v!r}")
        self.cache_block, self.max_bytes = cache_block, max_bytes
        self.clear()

    def clear(self) -> None:
        """Drop every node and reset the counters."""
        self._root = _Node(depth=0, parent=None, kv=[])
        self._config = None
        self._fingerprint = None
        self._clock = 0
        self._bytes = self._n_nodes = self._n_entries = 0
        self._cursor: tuple[list[int], _Node] | None = None  # last block node inserted at
        self._lru: list[tuple[int, _Node]] = []  # (last_used, node), lazily invalidated min-heap
        self._counts = dict(hits=0, misses=0, hit_tokens=0, evictions=0)

    # ------------------------------------------------------------------ queries
    def stats(self) -> dict:
        """Counters kept up to date by insert/match/evict (cheap; safe to read from another thread)."""
        return dict(self._counts, bytes=self._bytes, entries=self._n_entries, nodes=self._n_nodes)

    def _touch(self, node: _Node) -> None:
        """Mark ``node``'s snapshot as used now (for LRU)."""
        self._clock += 1
        node.last_used = self._clock
        heapq.heappush(self._lru, (node.last_used, node))
        if len(self._lru) > 2 * self._n_entries + 64:  # drop stale heap entries now and then
            self._lru = [(n.last_used, n) for t, n in self._lru if n.kda is not None and n.last_used == t]
            heapq.heapify(self._lru)

    def _tail(self, node: _Node, tokens: list[int], limit: int) -> _Node | None:
        """The longest prompt-end child of ``node`` (a leaf, shorter than a block) that continues
        ``tokens`` within ``tokens[:limit]``."""
        d = node.depth
        for n in sorted(node.tail_lengths, reverse=True):
            child = node.children.get(tuple(tokens[d:d + n])) if d + n <= limit else None
            if child is not None and child.kda is not None:
                return child
        return None

    def _deepest(self, tokens: list[int]) -> list[_Node] | None:
        """The root→hit path of the deepest snapshot at depth ≤ ``len(tokens) − 1`` (None: none)."""
        limit, B = len(tokens) - 1, self.cache_block
        node, path = self._root, []
        best: tuple[int, _Node | None] | None = None  # (block nodes of path used, prompt-end leaf)
        while True:
            tail = self._tail(node, tokens, limit)
            if tail is not None:
                best = (len(path), tail)
            d = node.depth
            node = node.children.get(tuple(tokens[d:d + B])) if d + B <= limit else None
            if node is None:
                break
            path.append(node)
            if node.kda is not None:  # deeper than any prompt-end leaf above it
                best = (len(path), None)
        if best is None:
            return None
        return path[: best[0]] + ([best[1]] if best[1] is not None else [])

    def peek(self, tokens: Sequence[int]) -> int:
        """How many tokens of ``tokens`` ``match`` would cover now (0: a miss); touches nothing,
        counts nothing, copies nothing (the scheduler plans with it)."""
        nodes = self._deepest(_token_ids(tokens))
        return 0 if nodes is None else nodes[-1].depth

    def match(self, tokens: Sequence[int]) -> PrefixHit:
        """Deepest snapshot covering a prefix of ``tokens`` (at most ``len(tokens) − 1`` of them)."""
        nodes = self._deepest(_token_ids(tokens))
        if nodes is None:
            self._counts["misses"] += 1
            return PrefixHit(0, None)
        hit = nodes[-1]
        self._touch(hit)
        self._counts["hits"] += 1
        self._counts["hit_tokens"] += hit.depth
        return PrefixHit(hit.depth, self._build(nodes))

    def _build(self, path: list[_Node]) -> K3Cache:
        """A fresh batch-1 cache: KV concatenated along ``path``, the last node's snapshot copied."""
        cfg, last = self._config, path[-1]
        cache = K3Cache(cfg, 1)
        kda_states = iter(last.kda)
        for m, l in enumerate(cfg.mla_layer_ids):
            st: MLAState = cache.layers[l]
            c = torch.cat([n.kv[m][0] for n in path], 0)
            k_pe = torch.cat([n.kv[m][1] for n in path], 0)
            st.append(c.unsqueeze(0), k_pe.unsqueeze(0))
        for l in cfg.kda_layer_ids:
            st: KDAState = cache.layers[l]
            conv, rec = next(kda_states)
            st.conv, st.recurrent = conv.unsqueeze(0).clone(), rec.unsqueeze(0).clone()
        cache.seq_len = last.depth
        return cache

    # ------------------------------------------------------------------ insert
    def _check_insert(self, tokens: list[int], cache: K3Cache) -> None:
        if not isinstance(cache, K3Cache):
            raise K3Error(f"PrefixCache.insert: cache must be a K3Cache, got {type(cache).__name__}")
        if cache.batch_size != 1:
            raise K3Error(f"PrefixCache.insert: cache must hold one sequence, got batch_size={cache.batch_size}")
        if not tokens:
            raise K3Error("PrefixCache.insert: tokens must not be empty")
        if cache.seq_len != len(tokens):
            raise K3Error(f"PrefixCache.insert: cache has seen {cache.seq_len} tokens, "
                          f"tokens has {len(tokens)}")
        if self._fingerprint is not None and cache.fingerprint != self._fingerprint:
            raise K3Error("PrefixCache.insert: cache was built for a different config than the tree's")
        for l, st in enumerate(cache.layers):
            if st.is_empty:
                raise K3Error(f"PrefixCache.insert: layer {l} state is empty after {len(tokens)} tokens")

    def insert(self, tokens: Sequence[int], cache: K3Cache) -> None:
        """Record the state of ``cache`` (batch 1, has seen exactly ``tokens``) at depth len(tokens)."""
        tokens = _token_ids(tokens)
        self._check_insert(tokens, cache)
        if self._config is None:
            self._config, self._fingerprint = cache.config, cache.fingerprint
        cfg, L, B = self._config, len(tokens), self.cache_block
        mla = [cache.layers[l] for l in cfg.mla_layer_ids]
        node = self._resume_point(tokens)
        for d in range(node.depth, L, B):
            end = min(d + B, L)
            key = tuple(tokens[d:end])
            child = node.children.get(key)
            if child is None:
                kv = [(st.c[0, d:end].clone(), st.k_pe[0, d:end].clone()) for st in mla]
                child = _Node(depth=end, parent=node, kv=kv, key=key)
                node.children[key] = child
                if end - d < B:
                    node.tail_lengths.add(end - d)
                self._bytes += child.kv_bytes
                self._n_nodes += 1
            node = child
        if L % B == 0:
            self._cursor = (tokens, node)
        if node.kda is None:
            node.kda = [(cache.layers[l].conv[0].clone(), cache.layers[l].recurrent[0].clone())
                        for l in cfg.kda_layer_ids]
            self._bytes += node.kda_bytes
            self._n_entries += 1
        self._touch(node)
        self._evict()

    def _resume_point(self, tokens: list[int]) -> _Node:
        """Where an insert's walk can start: the block node of the previous insert when ``tokens``
        extend its prefix and it is still in the tree (the engine inserts one prompt's boundaries
        in order, so each insert walks only the new blocks), else the root."""
        if self._cursor is not None:
            prev, node = self._cursor
            if node.parent is not None and len(tokens) > node.depth and tokens[:node.depth] == prev[:node.depth]:
                return node
        return self._root

    # ------------------------------------------------------------------ eviction
    def _evict(self) -> None:
        while self._bytes > self.max_bytes and self._lru:
            t, victim = heapq.heappop(self._lru)
            if victim.kda is None or victim.last_used != t:  # stale: evicted or used since
                continue
            self._bytes -= victim.kda_bytes
            victim.kda = None
            self._n_entries -= 1
            self._counts["evictions"] += 1
            self._prune(victim)

    def _prune(self, node: _Node) -> None:
        """Remove ``node`` and its ancestors while they are leaves without a snapshot."""
        while node is not self._root and not node.children and node.kda is None:
            parent = node.parent
            del parent.children[node.key]
            if len(node.key) < self.cache_block and not any(len(k) == len(node.key) for k in parent.children):
                parent.tail_lengths.discard(len(node.key))
            node.parent = None  # detached (see _resume_point)
            self._bytes -= node.kv_bytes
            self._n_nodes -= 1
            node = parent
