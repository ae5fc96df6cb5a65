"""Per-layer inference state: KDA conv + recurrent state, Gated MLA latent KV (SPEC §3.1, §3.2, §6).

A ``K3Cache`` holds one entry per decoder layer, in layer order: a ``KDAState`` for KDA layers and
an ``MLAState`` for MLA layers. Layers update their entry in place when called as
``layer(x, state=cache.layers[l])``; the decoder advances ``cache.seq_len`` once per forward.

Every tensor has the batch first, so a cache can be reordered (``select``), forked (``clone``),
cut into per-sequence caches (``split``) and put back together (``cat``) — what batching, beam
search, the prefix cache and the prefill→decode hand-over need. All sequences of one cache share
``seq_len`` (no padding inside a cache).

States are empty (tensors ``None``) until a layer first writes them, so a fresh cache costs nothing
and takes its device and dtype from the model. Caches are inference objects: run under
``torch.no_grad()`` (the MLA buffers are written in place).
"""

from __future__ import annotations

import copy
from typing import Callable, Sequence

import torch

from k3.config import K3Config

__all__ = ["KDAState", "MLAState", "K3Cache", "check_layer_call"]


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
            if any(t is None for t in ts) and not all(t is None for t in ts):
                raise ValueError(f"cannot concatenate KDA states where only some hold a {name} state")
            setattr(out, name, None if ts[0] is None else torch.cat(ts, 0))
        return out

    def __repr__(self) -> str:
        shapes = {n: None if t is None else tuple(t.shape) for n, t in (("conv", self.conv),
                                                                         ("recurrent", self.recurrent))}
        return f"KDAState(batch_size={self.batch_size}, {shapes})"


class MLAState:
    """Latent KV cache of one Gated MLA layer: per token the normalized latent ``c`` [kv_lora_rank]
    and the shared ``k_pe`` [qk_rope_head_dim].

    Tokens live in buffers that grow by doubling, so appending one token is O(1) amortised
    instead of a full copy; ``c`` / ``k_pe`` are views of the filled part, [B, T, ·].
    """

    def __init__(self, batch_size: int, kv_lora_rank: int, qk_rope_head_dim: int):
        self.batch_size = batch_size
        self.kv_lora_rank, self.qk_rope_head_dim = kv_lora_rank, qk_rope_head_dim
        self.length = 0
        self._c: torch.Tensor | None = None      # [B, capacity, kv_lora_rank]
        self._k_pe: torch.Tensor | None = None   # [B, capacity, qk_rope_head_dim]

    @property
    def is_empty(self) -> bool:
        return self.length == 0

    @property
    def c(self) -> torch.Tensor | None:
        return None if self._c is None else self._c[:, : self.length]

    @property
    def k_pe(self) -> torch.Tensor | None:
        return None if self._k_pe is None else self._k_pe[:, : self.length]

    def append(self, c: torch.Tensor, k_pe: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Add c [B, T, r] and k_pe [B, T, rope]; return all cached tokens (views, [B, S, ·])."""
        B, T = c.shape[:2]
        if B != self.batch_size:
            raise ValueError(f"MLA state holds batch_size={self.batch_size}, got {B} new sequences")
        need = self.length + T
        if self._c is None or need > self._c.shape[1]:
            cap = max(need, 2 * (0 if self._c is None else self._c.shape[1]), 16)
            new_c = c.new_empty(B, cap, self.kv_lora_rank)
            new_pe = k_pe.new_empty(B, cap, self.qk_rope_head_dim)
            if self.length:
                new_c[:, : self.length] = self.c
                new_pe[:, : self.length] = self.k_pe
            self._c, self._k_pe = new_c, new_pe
        self._c[:, self.length: need] = c
        self._k_pe[:, self.length: need] = k_pe
        self.length = need
        return self.c, self.k_pe

    def _with(self, fn: Callable[[torch.Tensor], torch.Tensor], batch_size: int) -> "MLAState":
        out = MLAState(batch_size, self.kv_lora_rank, self.qk_rope_head_dim)
        out.length = self.length
        # Only the filled part is copied: a fork or a hand-over carries no spare capacity.
        out._c, out._k_pe = _map(self.c, fn), _map(self.k_pe, fn)
        return out

    def select(self, idx: torch.Tensor) -> "MLAState":
        return self._with(lambda t: t.index_select(0, idx.to(t.device)), len(idx))

    def clone(self) -> "MLAState":
        return self._with(lambda t: t.clone(), self.batch_size)

    def to(self, device: torch.device | str) -> "MLAState":
        return self._with(lambda t: t.to(device), self.batch_size)

    def nbytes(self) -> int:
        """Bytes of the cached tokens (spare buffer capacity not counted)."""
        return _nbytes(self.c) + _nbytes(self.k_pe)

    @staticmethod
    def cat(states: Sequence["MLAState"]) -> "MLAState":
        first = states[0]
        lengths = {s.length for s in states}
        if len(lengths) != 1:
            raise ValueError(f"cannot concatenate MLA states of different lengths {sorted(lengths)}")
        out = MLAState(sum(s.batch_size for s in states), first.kv_lora_rank, first.qk_rope_head_dim)
        out.length = first.length
        if first.length:
            out._c = torch.cat([s.c for s in states], 0)
            out._k_pe = torch.cat([s.k_pe for s in states], 0)
        return out

    def __repr__(self) -> str:
        return f"MLAState(batch_size={self.batch_size}, length={self.length})"


LayerState = KDAState | MLAState


class K3Cache:
    """Inference state of a whole K3 model for ``batch_size`` sequences.

    ``layers[l]`` is a ``KDAState`` when ``config.is_kda_layer(l)`` else an ``MLAState``;
    ``seq_len`` counts the tokens already seen (advanced by the decoder, not by the layers).
    """

    def __init__(self, config: K3Config, batch_size: int):
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size <= 0:
            raise ValueError(f"batch_size must be an int > 0, got {batch_size!r}")
        self.config = config
        self.fingerprint = config.fingerprint()
        self.batch_size = batch_size
        self.seq_len = 0
        lac = config.linear_attn_config
        self.layers: list[LayerState] = [
            KDAState(batch_size, lac.num_heads, lac.head_dim, lac.short_conv_kernel_size)
            if config.is_kda_layer(l) else
            MLAState(batch_size, config.kv_lora_rank, config.qk_rope_head_dim)
            for l in range(config.num_hidden_layers)
        ]

    def check(self, config: K3Config, batch_size: int) -> None:
        """Raise ValueError unless this cache was built for ``config`` and ``batch_size`` sequences."""
        if config.fingerprint() != self.fingerprint:
            theirs, mine = dict(config.fingerprint()), dict(self.fingerprint)
            diff = sorted(k for k in set(theirs) | set(mine) if theirs.get(k) != mine.get(k))
            raise ValueError(f"cache was built for a different config (fields differ: {diff})")
        if batch_size != self.batch_size:
            raise ValueError(f"cache holds batch_size={self.batch_size} sequences, got a batch of {batch_size}")

    def _with_layers(self, layers: list[LayerState], batch_size: int) -> "K3Cache":
        out = copy.copy(self)
        out.layers, out.batch_size = layers, batch_size
        return out

    def select(self, batch_indices: Sequence[int] | torch.Tensor) -> "K3Cache":
        """A new cache holding sequences ``batch_indices`` (reorder, repeat or drop)."""
        idx = torch.as_tensor(batch_indices, dtype=torch.long).flatten()
        if idx.numel() == 0:
            raise ValueError("select needs at least one batch index")
        if int(idx.min()) < -self.batch_size or int(idx.max()) >= self.batch_size:
            raise ValueError(f"batch indices {idx.tolist()} out of range for batch_size={self.batch_size}")
        idx = idx % self.batch_size
        return self._with_layers([s.select(idx) for s in self.layers], int(idx.numel()))

    def clone(self) -> "K3Cache":
        """An independent copy (fork a prefix)."""
        return self._with_layers([s.clone() for s in self.layers], self.batch_size)

    def split(self) -> list["K3Cache"]:
        """One batch-1 cache per sequence (prefix-cache boundaries, prefill→decode hand-over)."""
        return [self.select([i]) for i in range(self.batch_size)]

    @staticmethod
    def cat(caches: Sequence["K3Cache"]) -> "K3Cache":
        """Stack caches of the same config and ``seq_len`` along the batch."""
        if not caches:
            raise ValueError("cat needs at least one cache")
        first = caches[0]
        for c in caches[1:]:
            if c.fingerprint != first.fingerprint:
                raise ValueError("cannot concatenate caches built for different configs")
            if c.seq_len != first.seq_len:
                raise ValueError(f"cannot concatenate caches at different seq_len "
                                 f"({first.seq_len} and {c.seq_len})")
        layers = [type(group[0]).cat(group) for group in zip(*(c.layers for c in caches))]
        return first._with_layers(layers, sum(c.batch_size for c in caches))

    def to(self, device: torch.device | str) -> "K3Cache":
        """This cache on ``device`` (tensors already there are shared, as with ``Tensor.to``; layers
        never write shared memory: KDA replaces its tensors, MLA regrows a full buffer)."""
        return self._with_layers([s.to(device) for s in self.layers], self.batch_size)

    def nbytes(self) -> int:
        return sum(s.nbytes() for s in self.layers)

    def __repr__(self) -> str:
        n_kda = sum(isinstance(s, KDAState) for s in self.layers)
        return (f"K3Cache(batch_size={self.batch_size}, seq_len={self.seq_len}, "
                f"kda_layers={n_kda}, mla_layers={len(self.layers) - n_kda}, nbytes={self.nbytes()})")
