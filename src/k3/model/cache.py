"""Per-layer inference state: KDA conv + recurrent state, Gated MLA latent KV (SPEC §3.1, §3.2, §6).

A ``K3Cache`` holds one entry per decoder layer, in layer order: a ``KDAState`` for KDA layers and
an ``MLAState`` for MLA layers. Layers update their entry in place when called as
``layer(x, state=cache.layers[l])``; the decoder advances ``cache.seq_lens`` once per forward.

Sequences of one cache may have different lengths (``seq_lens`` [B]): KDA state is constant-size
per row, and the MLA buffers are right-padded with zeros to the longest row, each row masked at its
own length by the layer. Every tensor has the batch first, so a cache can be reordered
(``select``), forked (``clone``), cut into per-sequence caches (``split``, padding trimmed) and put
back together (``cat``, any lengths) — what batching, the prefix cache and the prefill→decode
hand-over need. ``cache_bytes_per_sequence`` gives the state size of one sequence from a config.

States are empty (tensors ``None``) until a layer first writes them, so a fresh cache costs nothing
and takes its device and dtype from the model. Caches are inference objects: run under
``torch.no_grad()`` (the MLA buffers are written in place).
"""

from __future__ import annotations

import copy
from typing import Callable, Sequence

import torch

from k3.config import K3Config
from k3.errors import K3Error

__all__ = ["KDAState", "MLAState", "K3Cache", "check_layer_call", "cache_bytes_per_sequence"]


def _map(t: torch.Tensor | None, fn: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor | None:
    return None if t is None else fn(t)


def _nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def check_layer_call(layer, x: torch.Tensor, state, state_type: type, geometry: tuple[str, ...]) -> None:
    """The checks every token-mixer layer makes on ``forward(x, state)``, errors naming the layer.

    ``geometry`` names attributes that the state and the layer must agree on (same names on both).
    """
    name = f"{type(layer).__name__} layer {layer.layer_idx}"
    if x.dim() != 3 or x.shape[-1] != layer.hidden_size:
        raise ValueError(f"{name}: x must be [B, T, hidden_size={layer.hidden_size}], got shape {tuple(x.shape)}")
    if state is None:
        return
    if not isinstance(state, state_type):
        raise TypeError(f"{name}: state must be a {state_type.__name__}, got {type(state).__name__}")
    if state.batch_size != x.shape[0]:
        raise ValueError(f"{name}: state holds batch_size={state.batch_size}, x has batch {x.shape[0]}")
    have = tuple(getattr(state, f) for f in geometry)
    want = tuple(getattr(layer, f) for f in geometry)
    if have != want:
        raise ValueError(f"{name}: state is for ({', '.join(geometry)})={have}, layer has {want}")


class KDAState:
    """State of one KDA layer for ``batch_size`` sequences.

    * ``conv``: [B, 3P, K-1], the last K-1 inputs of the short convolutions, channels ordered
      ``q | k | v`` (P = num_heads·head_dim, K = short_conv_kernel_size), in the projection dtype.
      One tensor rather than three because the layer runs the three depthwise convs as one
      grouped conv; it is also transformers' / fla's fused ``conv1d`` layout.
    * ``recurrent``: [B, nh, d, d] fp32, the delta-rule state S (key dim first).
    """

    def __init__(self, batch_size: int, num_heads: int, head_dim: int, conv_kernel_size: int):
        self.batch_size = batch_size
        self.num_heads, self.head_dim, self.conv_kernel_size = num_heads, head_dim, conv_kernel_size
        self.conv: torch.Tensor | None = None
        self.recurrent: torch.Tensor | None = None

    @property
    def is_empty(self) -> bool:
        return self.conv is None and self.recurrent is None

    def _with(self, fn: Callable[[torch.Tensor], torch.Tensor], batch_size: int) -> "KDAState":
        out = KDAState(batch_size, self.num_heads, self.head_dim, self.conv_kernel_size)
        out.conv, out.recurrent = _map(self.conv, fn), _map(self.recurrent, fn)
        return out

    def select(self, idx: torch.Tensor) -> "KDAState":
        return self._with(lambda t: t.index_select(0, idx.to(t.device)), len(idx))

    def clone(self) -> "KDAState":
        return self._with(torch.clone, self.batch_size)

    def to(self, device: torch.device | str) -> "KDAState":
        return self._with(lambda t: t.to(device), self.batch_size)

    def nbytes(self) -> int:
        return _nbytes(self.conv) + _nbytes(self.recurrent)

    @staticmethod
    def cat(states: Sequence["KDAState"]) -> "KDAState":
        first = states[0]
        out = KDAState(sum(s.batch_size for s in states), first.num_heads, first.head_dim,
                       first.conv_kernel_size)
        for name in ("conv", "recurrent"):
            ts = [getattr(s, name) for s in states]
            ref = next((t for t in ts if t is not None), None)
            if ref is not None:  # a fresh sequence's state is all zeros (what the layer starts from)
                ts = [ref.new_zeros(s.batch_size, *ref.shape[1:]) if t is None else t for s, t in zip(states, ts)]
            setattr(out, name, None if ref is None else torch.cat(ts, 0))
        return out

    def __repr__(self) -> str:
        shapes = {n: None if t is None else tuple(t.shape) for n, t in (("conv", self.conv),
                                                                         ("recurrent", self.recurrent))}
        return f"KDAState(batch_size={self.batch_size}, {shapes})"


class MLAState:
    """Latent KV cache of one Gated MLA layer: per token the normalized latent ``c`` [kv_lora_rank]
    and the shared ``k_pe`` [qk_rope_head_dim], for ``batch_size`` sequences of their own lengths.

    ``lengths``: CPU LongTensor [B], tokens cached per row. Row b's tokens live at buffer slots
    ``0 .. lengths[b]-1``; slots past a row's length are zeros (padding, masked by the layer).
    Buffers grow by doubling, so appending one token is O(1) amortised instead of a full copy.
    ``c`` / ``k_pe`` are views of the filled part, [B, max(lengths), ·] (exactly [B, T, ·] when all
    rows are equal); ``row(b)`` gives one row without its padding.
    """

    def __init__(self, batch_size: int, kv_lora_rank: int, qk_rope_head_dim: int):
        self.batch_size = batch_size
        self.kv_lora_rank, self.qk_rope_head_dim = kv_lora_rank, qk_rope_head_dim
        self._set_lengths(torch.zeros(batch_size, dtype=torch.long))
        self._c: torch.Tensor | None = None      # [B, capacity, kv_lora_rank]
        self._k_pe: torch.Tensor | None = None   # [B, capacity, qk_rope_head_dim]

    def _set_lengths(self, lengths: torch.Tensor) -> None:
        """Replace (never mutate: callers may hold the old tensor) the lengths and their bounds."""
        self.lengths = lengths
        self._max = int(lengths.max()) if len(lengths) else 0
        self._min = int(lengths.min()) if len(lengths) else 0

    @property
    def uniform(self) -> bool:
        """All rows hold the same number of tokens (no padding inside the buffers)."""
        return self._min == self._max

    @property
    def max_length(self) -> int:
        return self._max

    @property
    def length(self) -> int:
        """The common length of all rows; an error when rows differ (use ``lengths``)."""
        if not self.uniform:
            raise K3Error(f"MLA state rows have different lengths {self.lengths.tolist()}; use .lengths")
        return self._max

    @property
    def is_empty(self) -> bool:
        return self._max == 0

    @property
    def c(self) -> torch.Tensor | None:
        return None if self._c is None else self._c[:, : self._max]

    @property
    def k_pe(self) -> torch.Tensor | None:
        return None if self._k_pe is None else self._k_pe[:, : self._max]

    def row(self, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Row ``b``'s cached tokens without padding: (c [T_b, r], k_pe [T_b, p])."""
        if not -self.batch_size <= b < self.batch_size:
            raise K3Error(f"row {b} out of range for batch_size={self.batch_size}")
        n = int(self.lengths[b])
        if self._c is None:
            raise K3Error("MLA state is empty: no rows to read")
        return self._c[b, :n], self._k_pe[b, :n]

    def _grow(self, like_c: torch.Tensor, like_pe: torch.Tensor, need: int) -> None:
        """Make room for ``need`` slots per row; new slots are zeros (padding must stay finite)."""
        cap = max(need, 2 * (0 if self._c is None else self._c.shape[1]), 16)
        new_c = like_c.new_zeros(self.batch_size, cap, self.kv_lora_rank)
        new_pe = like_pe.new_zeros(self.batch_size, cap, self.qk_rope_head_dim)
        if self._max:
            new_c[:, : self._max] = self.c
            new_pe[:, : self._max] = self.k_pe
        self._c, self._k_pe = new_c, new_pe

    def append(self, c: torch.Tensor, k_pe: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Add c [B, T, r], k_pe [B, T, p] to every row at slots ``lengths[b] .. lengths[b]+T-1``;
        return the filled buffers (views, [B, max(lengths), ·])."""
        B, T = c.shape[:2]
        if B != self.batch_size:
            raise ValueError(f"MLA state holds batch_size={self.batch_size}, got {B} new sequences")
        need = self._max + T
        if self._c is None or need > self._c.shape[1]:
            self._grow(c, k_pe, need)
        if self.uniform:
            self._c[:, self._max: need] = c
            self._k_pe[:, self._max: need] = k_pe
        else:
            dev = self._c.device
            pos = self.lengths.to(dev)[:, None] + torch.arange(T, device=dev)        # [B, T]
            rows = torch.arange(B, device=dev)[:, None].expand(B, T)
            self._c[rows, pos] = c.to(self._c.dtype)
            self._k_pe[rows, pos] = k_pe.to(self._k_pe.dtype)
        self.lengths = self.lengths + T
        self._max, self._min = self._max + T, self._min + T
        return self.c, self.k_pe

    def _with(self, fn: Callable[[torch.Tensor], torch.Tensor], lengths: torch.Tensor) -> "MLAState":
        """A new state of ``len(lengths)`` rows whose buffers are ``fn`` of the filled part, trimmed
        to the new longest row. A fork or a hand-over carries no spare capacity."""
        out = MLAState(len(lengths), self.kv_lora_rank, self.qk_rope_head_dim)
        out._set_lengths(lengths)
        if out._max:
            out._c, out._k_pe = fn(self.c)[:, : out._max], fn(self.k_pe)[:, : out._max]
        return out

    def select(self, idx: torch.Tensor) -> "MLAState":
        idx = idx.to(torch.long)
        return self._with(lambda t: t.index_select(0, idx.to(t.device)), self.lengths.index_select(0, idx.cpu()))

    def clone(self) -> "MLAState":
        return self._with(lambda t: t.clone(), self.lengths.clone())

    def to(self, device: torch.device | str) -> "MLAState":
        return self._with(lambda t: t.to(device), self.lengths.clone())

    def nbytes(self) -> int:
        """Bytes of the cached tokens (neither padding nor spare buffer capacity counted)."""
        if self._c is None:
            return 0
        per_token = self.kv_lora_rank * self._c.element_size() + self.qk_rope_head_dim * self._k_pe.element_size()
        return int(self.lengths.sum()) * per_token

    @staticmethod
    def cat(states: Sequence["MLAState"]) -> "MLAState":
        """Stack states along the batch; rows shorter than the longest are zero-padded."""
        first = states[0]
        out = MLAState(sum(s.batch_size for s in states), first.kv_lora_rank, first.qk_rope_head_dim)
        out._set_lengths(torch.cat([s.lengths for s in states]))
        filled = [s for s in states if s._c is not None and s._max]
        if out._max:
            ref_c, ref_pe = filled[0].c, filled[0].k_pe
            out._c = ref_c.new_zeros(out.batch_size, out._max, first.kv_lora_rank)
            out._k_pe = ref_pe.new_zeros(out.batch_size, out._max, first.qk_rope_head_dim)
            b = 0
            for s in states:
                if s._max:
                    out._c[b: b + s.batch_size, : s._max] = s.c
                    out._k_pe[b: b + s.batch_size, : s._max] = s.k_pe
                b += s.batch_size
        return out

    def __repr__(self) -> str:
        lens = self._max if self.uniform else self.lengths.tolist()
        return f"MLAState(batch_size={self.batch_size}, length={lens})"


LayerState = KDAState | MLAState


class K3Cache:
    """Inference state of a whole K3 model for ``batch_size`` sequences.

    ``layers[l]`` is a ``KDAState`` when ``config.is_kda_layer(l)`` else an ``MLAState``;
    ``seq_lens`` (CPU LongTensor [B]) counts the tokens each sequence has already seen (advanced by
    the decoder, not by the layers). ``seq_len`` is the common length when all rows are equal.
    """

    def __init__(self, config: K3Config, batch_size: int):
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size <= 0:
            raise ValueError(f"batch_size must be an int > 0, got {batch_size!r}")
        self.config = config
        self.fingerprint = config.fingerprint()
        self.batch_size = batch_size
        self.seq_lens = torch.zeros(batch_size, dtype=torch.long)
        lac = config.linear_attn_config
        self.layers: list[LayerState] = [
            KDAState(batch_size, lac.num_heads, lac.head_dim, lac.short_conv_kernel_size)
            if config.is_kda_layer(l) else
            MLAState(batch_size, config.kv_lora_rank, config.qk_rope_head_dim)
            for l in range(config.num_hidden_layers)
        ]

    @property
    def seq_len(self) -> int:
        """Tokens seen by every sequence; an error when the rows differ (use ``seq_lens``)."""
        lo, hi = int(self.seq_lens.min()), int(self.seq_lens.max())
        if lo != hi:
            raise K3Error(f"cache rows have different lengths {self.seq_lens.tolist()}; use .seq_lens")
        return hi

    @seq_len.setter
    def seq_len(self, value: int) -> None:
        self.seq_lens = torch.full((self.batch_size,), int(value), dtype=torch.long)

    @property
    def max_seq_len(self) -> int:
        return int(self.seq_lens.max())

    def check(self, config: K3Config, batch_size: int) -> None:
        """Raise ValueError unless this cache was built for ``config`` and ``batch_size`` sequences
        (the config object it was built from passes without recomputing its fingerprint: a decode
        step calls this every token)."""
        if config is not self.config and config.fingerprint() != self.fingerprint:
            theirs, mine = dict(config.fingerprint()), dict(self.fingerprint)
            diff = sorted(k for k in set(theirs) | set(mine) if theirs.get(k) != mine.get(k))
            raise ValueError(f"cache was built for a different config (fields differ: {diff})")
        if batch_size != self.batch_size:
            raise ValueError(f"cache holds batch_size={self.batch_size} sequences, got a batch of {batch_size}")

    def _with_layers(self, layers: list[LayerState], seq_lens: torch.Tensor) -> "K3Cache":
        out = copy.copy(self)
        out.layers, out.batch_size, out.seq_lens = layers, len(seq_lens), seq_lens
        return out

    def select(self, batch_indices: Sequence[int] | torch.Tensor) -> "K3Cache":
        """A new cache holding sequences ``batch_indices`` (reorder, repeat or drop); MLA padding is
        trimmed to the longest selected row."""
        idx = torch.as_tensor(batch_indices, dtype=torch.long).flatten().cpu()
        if idx.numel() == 0:
            raise ValueError("select needs at least one batch index")
        if int(idx.min()) < -self.batch_size or int(idx.max()) >= self.batch_size:
            raise ValueError(f"batch indices {idx.tolist()} out of range for batch_size={self.batch_size}")
        idx = idx % self.batch_size
        return self._with_layers([s.select(idx) for s in self.layers], self.seq_lens.index_select(0, idx))

    def clone(self) -> "K3Cache":
        """An independent copy (fork a prefix)."""
        return self._with_layers([s.clone() for s in self.layers], self.seq_lens.clone())

    def split(self) -> list["K3Cache"]:
        """One batch-1 cache per sequence, without padding (prefix-cache boundaries, hand-over)."""
        return [self.select([i]) for i in range(self.batch_size)]

    @staticmethod
    def cat(caches: Sequence["K3Cache"]) -> "K3Cache":
        """Stack caches of the same config along the batch; their ``seq_lens`` may differ (MLA rows
        are zero-padded to the longest and masked by the layer)."""
        if not caches:
            raise ValueError("cat needs at least one cache")
        first = caches[0]
        for c in caches[1:]:
            if c.fingerprint != first.fingerprint:
                raise ValueError("cannot concatenate caches built for different configs")
        layers = [type(group[0]).cat(group) for group in zip(*(c.layers for c in caches))]
        return first._with_layers(layers, torch.cat([c.seq_lens for c in caches]))

    def to(self, device: torch.device | str) -> "K3Cache":
        """This cache on ``device`` (tensors already there are shared, as with ``Tensor.to``; layers
        never write shared memory: KDA replaces its tensors, MLA regrows a full buffer).
        ``seq_lens`` stays on the CPU (host bookkeeping, no device syncs)."""
        return self._with_layers([s.to(device) for s in self.layers], self.seq_lens.clone())

    def nbytes(self) -> int:
        """Bytes of state actually held: KDA states plus each row's cached MLA tokens (padding and
        spare buffer capacity not counted)."""
        return sum(s.nbytes() for s in self.layers)

    def __repr__(self) -> str:
        n_kda = sum(isinstance(s, KDAState) for s in self.layers)
        lo, hi = int(self.seq_lens.min()), int(self.seq_lens.max())
        lens = hi if lo == hi else self.seq_lens.tolist()
        return (f"K3Cache(batch_size={self.batch_size}, seq_len={lens}, "
                f"kda_layers={n_kda}, mla_layers={len(self.layers) - n_kda}, nbytes={self.nbytes()})")


def cache_bytes_per_sequence(config: K3Config, T: int, dtype: torch.dtype = torch.float32) -> dict[str, int]:
    """Bytes of one sequence's inference state after ``T`` tokens, from the config alone.

    With e = bytes per element of ``dtype`` (the model's activation dtype), per KDA layer nh heads
    of size d, conv kernel K, per MLA layer latent rank r and rope dim p, L layers in all::

        kda_state          = n_kda · (nh·d·d · 4  +  3·nh·d·(K−1) · e)   recurrent S is always fp32
        mla_latent         = n_mla · T · (r + p) · e
        total              = kda_state + mla_latent
        all_mla_equivalent = L · T · (r + p) · e                          every layer an MLA layer
    """
    if isinstance(T, bool) or not isinstance(T, int) or T < 0:
        raise K3Error(f"T must be an int >= 0, got {T!r}")
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise K3Error(f"dtype must be a floating torch.dtype, got {dtype!r}")
    e = dtype.itemsize
    lac = config.linear_attn_config
    n_kda = sum(config.is_kda_layer(l) for l in range(config.num_hidden_layers))
    n_mla = config.num_hidden_layers - n_kda
    P = lac.num_heads * lac.head_dim
    kda = n_kda * (P * lac.head_dim * 4 + 3 * P * (lac.short_conv_kernel_size - 1) * e)
    per_token = (config.kv_lora_rank + config.qk_rope_head_dim) * e
    mla = n_mla * T * per_token
    return dict(kda_state=kda, mla_latent=mla, total=kda + mla,
                all_mla_equivalent=config.num_hidden_layers * T * per_token)
