"""Gated Multi-head Latent Attention with NoPE (SPEC §3.2).

Per token, with nh heads, latent rank r, per-head dims n (nope), p ("rope", never rotated), v::

    q            = q_b_proj(RMSNorm(q_a_proj x))  | q_proj x          -> per head [q_nope n | q_pe p]
    [c, k_pe]    = kv_a_proj_with_mqa x,  c = RMSNorm(c)               c [r], k_pe [p] shared by all heads
    [k_nope, v]  = kv_b_proj c = [W_UK c | W_UV c]                     per head
    s_ij         = (q_nope_i · k_nope_j + q_pe_i · k_pe_j) / sqrt(n + p),   causal softmax over j
    out          = o_proj( (Σ_j a_ij v_j) ⊙ sigmoid(g_proj x) )        gate only when mla_use_output_gate

Two paths compute the same thing (DeepSeek-V3 inference style):

* ``naive``: expand k, v for every cached token with ``kv_b_proj`` and call SDPA.
* ``absorb``: q_nope·(W_UK c) = (W_UKᵀ q_nope)·c and Σ a (W_UV c) = W_UV (Σ a c), so attention runs
  directly over the cached latents c and k_pe — O(r + p) per cached token instead of O(nh(n+v)).

``attn_impl='auto'`` uses ``naive`` for prefill and ``absorb`` to decode (≤ ``absorb_max_tokens`` new
tokens) from a non-empty cache. The cache (:class:`~k3.model.cache.MLAState`) stores c and k_pe.

Rows of one cache may hold different numbers of tokens L_b: the T new tokens of row b sit at
positions L_b .. L_b+T−1 and query t attends key j iff j ≤ L_b + t (causality and the row's zero
padding in one mask). The naive path runs its queries in chunks (``prefill_query_chunk``, fewer
when the key range is long: ``score_budget``), each over the decompressed keys of its causal
range, so a long prefill never builds [T, T] scores: memory grows linearly in T.

QK-Clip support: given ``stats`` (a :class:`k3.model.stats.ForwardStats` asked for max logits) the
forward adds [nh] fp32, the largest pre-softmax score s_ij = (q_i·k_j)·scale over the causal pairs
of the batch, per head (detached, computed under no_grad in query blocks; without ``stats`` nothing
is measured, so inference pays nothing). The trainer takes it (:class:`k3.train.optim.QKClip`) and
rescales the weights after the step.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from k3.config import K3Config
from k3.model.cache import MLAState, check_layer_call
from k3.model.norm import RMSNorm
from k3.model.stats import ForwardStats

__all__ = ["GatedMLA", "ATTN_IMPLS"]

ATTN_IMPLS = ("naive", "absorb", "auto")


def _query_mask(starts: torch.Tensor | None, t0: int, t1: int, S: int, offset: int,
                device: torch.device) -> torch.Tensor:
    """True where new query t (t0 ≤ t < t1) may attend cached key j < S.

    Query t of row b sits at absolute position ``starts[b] + t`` (the row's length before this
    call): the result is [B, 1, t1−t0, S]. With ``starts=None`` every row sits at ``offset + t``
    and the result is [t1−t0, S]. One rule covers causality and each row's padding.
    """
    j = torch.arange(S, device=device)
    t = torch.arange(t0, t1, device=device)
    if starts is None:
        return j[None, :] <= (offset + t)[:, None]
    return (j[None, None, :] <= (starts[:, None] + t[None, :])[:, :, None])[:, None]


class GatedMLA(nn.Module):
    """Gated MLA (NoPE). ``forward(x [B,T,H], state: MLAState | None = None) -> [B,T,H]``."""

    absorb_max_tokens = 16      # 'auto' absorbs when a cached sequence gets at most this many new tokens
    max_logit_block = 256       # query rows per block when measuring the max logits
    prefill_query_chunk = 1024  # most query rows per SDPA call in the naive path ...
    score_budget = 1 << 24      # ... and fewer when B·nh·rows·keys would exceed this many scores

    def __init__(self, config: K3Config, layer_idx: int, attn_impl: str = "auto"):
        super().__init__()
        self.layer_idx = layer_idx
        self.hidden_size = H = config.hidden_size
        self.num_heads = nh = config.num_attention_heads
        self.q_lora_rank = config.q_lora_rank
        self.kv_lora_rank = r = config.kv_lora_rank
        self.qk_nope_head_dim, self.qk_rope_head_dim = config.qk_nope_head_dim, config.qk_rope_head_dim
        self.v_head_dim = config.v_head_dim
        self.qk_head_dim = config.qk_head_dim
        self.use_output_gate = config.mla_use_output_gate
        self.initializer_range = config.initializer_range
        self.softmax_scale = self.qk_head_dim ** -0.5
        self.attn_impl = attn_impl

        if self.q_lora_rank is None:
            self.q_proj = nn.Linear(H, nh * self.qk_head_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(H, self.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, eps=config.latent_norm_eps)
            self.q_b_proj = nn.Linear(self.q_lora_rank, nh * self.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(H, r + self.qk_rope_head_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(r, eps=config.latent_norm_eps)
        self.kv_b_proj = nn.Linear(r, nh * (self.qk_nope_head_dim + self.v_head_dim), bias=False)
        if self.use_output_gate:
            self.g_proj = nn.Linear(H, nh * self.v_head_dim, bias=False)
        self.o_proj = nn.Linear(nh * self.v_head_dim, H, bias=False)
        self.reset_parameters()

    @property
    def attn_impl(self) -> str:
        return self._attn_impl

    @attn_impl.setter
    def attn_impl(self, value: str) -> None:
        if value not in ATTN_IMPLS:
            raise ValueError(f"attn_impl must be one of {ATTN_IMPLS}, got {value!r}")
        self._attn_impl = value

    @torch.no_grad()
    def reset_parameters(self) -> None:
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, mean=0.0, std=self.initializer_range)
            elif isinstance(m, RMSNorm):
                nn.init.ones_(m.weight)

    # ------------------------------------------------------------------ helpers
    def _check(self, x: torch.Tensor, state: MLAState | None) -> None:
        check_layer_call(self, x, state, MLAState, ("kv_lora_rank", "qk_rope_head_dim"))

    def _query(self, x: torch.Tensor) -> torch.Tensor:
        """x [B,T,H] -> q [B,T,nh,n+p]."""
        q = self.q_proj(x) if self.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        return q.view(*x.shape[:2], self.num_heads, self.qk_head_dim)

    def _latent(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B,T,H] -> normalized c [B,T,r], k_pe [B,T,p]."""
        c, k_pe = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        return self.kv_a_layernorm(c), k_pe

    @torch.no_grad()
    def _max_logits(self, q: torch.Tensor, k: torch.Tensor, starts: torch.Tensor | None) -> torch.Tensor:
        """q [B,nh,T,n+p], k [B,nh,S,n+p] (last T keys are the queries') -> per-head max score [nh] fp32."""
        T, S = q.shape[2], k.shape[2]
        best = q.new_full((q.shape[1],), float("-inf"), dtype=torch.float32)
        with torch.autocast(q.device.type, enabled=False):                    # fp32 scores
            for t0 in range(0, T, self.max_logit_block):
                qb = q[:, :, t0:t0 + self.max_logit_block].float()
                s = (qb @ k.float().transpose(-1, -2)) * self.softmax_scale      # [B, nh, tb, S]
                mask = _query_mask(starts, t0, t0 + qb.shape[2], S, S - T, q.device)
                s = s.masked_fill(~mask, float("-inf"))
                best = torch.maximum(best, s.amax(dim=(0, 2, 3)))
        return best

    def _query_chunk(self, B: int, S: int) -> int:
        """Query rows per SDPA call so that one call's scores hold ≤ ``score_budget`` elements."""
        most = self.prefill_query_chunk
        return max(min(16, most), min(most, self.score_budget // max(1, B * self.num_heads * S)))

    def _naive(self, q: torch.Tensor, c: torch.Tensor, k_pe: torch.Tensor,
               starts: torch.Tensor | None = None, stats: ForwardStats | None = None) -> torch.Tensor:
        """q [B,T,nh,n+p], c [B,S,r], k_pe [B,S,p] (the queries are the last T tokens of each row,
        row b's at positions ``starts[b]`` .. ; ``None``: all at S−T) -> [B,T,nh,v]; ``stats``: where
        the max logits go (None: not measured).

        Keys and values are decompressed once ([B, nh, S, ·], linear in S); queries run in chunks
        of ``_query_chunk`` rows, each attending only keys 0 .. (its last position), so no [T, S]
        score or mask tensor is built. A plain causal self-attention (S = T, no cache) that fits one
        chunk, or that is differentiated (training), is one fused causal SDPA call.
        """
        B, T, nh, _ = q.shape
        S = c.shape[1]
        k_nope, v = self.kv_b_proj(c).view(B, S, nh, -1).split([self.qk_nope_head_dim, self.v_head_dim], -1)
        k = torch.cat([k_nope, k_pe[:, :, None, :].expand(B, S, nh, self.qk_rope_head_dim)], -1)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, nh, ·, ·]
        if stats is not None:
            stats.add_max_logits(self, self._max_logits(q, k, starts))
        step = self._query_chunk(B, S)
        if S == T and starts is None and (T <= step or torch.is_grad_enabled()):
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.softmax_scale)
            return o.transpose(1, 2)
        outs = []
        for t0 in range(0, T, step):
            t1 = min(T, t0 + step)
            end = S - T + t1                     # no query of this chunk reaches a key ≥ end
            mask = _query_mask(starts, t0, t1, end, S - T, q.device)
            outs.append(F.scaled_dot_product_attention(q[:, :, t0:t1], k[:, :, :end], v[:, :, :end],
                                                       attn_mask=mask, scale=self.softmax_scale))
        o = outs[0] if len(outs) == 1 else torch.cat(outs, 2)
        return o.transpose(1, 2)

    def _absorb(self, q: torch.Tensor, c: torch.Tensor, k_pe: torch.Tensor,
                starts: torch.Tensor | None = None, stats: ForwardStats | None = None) -> torch.Tensor:
        """Same contract as ``_naive``, attending over the latents (W_UK into q, W_UV onto the output).

        Per head h: q_lat = W_UK[h]ᵀ q_nope [r]; s_j = (q_lat·c_j + q_pe·k_pe_j)·scale;
        out = W_UV[h] Σ_j softmax(s)_j c_j. Heads and queries share one [nh·T, ·] matmul per row.
        """
        B, T, nh, _ = q.shape
        n, p, r, S = self.qk_nope_head_dim, self.qk_rope_head_dim, self.kv_lora_rank, c.shape[1]
        w = self.kv_b_proj.weight.view(nh, n + self.v_head_dim, r)
        w_uk, w_uv = w[:, :n], w[:, n:]                                  # [nh, n, r], [nh, v, r]
        qh = q.permute(2, 0, 1, 3).reshape(nh, B * T, n + p)            # [nh, B·T, n+p]
        q_lat = torch.bmm(qh[..., :n], w_uk)                             # [nh, B·T, r]
        q_lat = q_lat.view(nh, B, T, r).transpose(0, 1).reshape(B, nh * T, r)
        q_pe = qh[..., n:].reshape(nh, B, T, p).transpose(0, 1).reshape(B, nh * T, p)
        scores = torch.baddbmm(torch.bmm(q_pe, k_pe.transpose(1, 2)), q_lat, c.transpose(1, 2))
        scores = scores.view(B, nh, T, S).float() * self.softmax_scale   # [B, nh, T, S]
        if T > 1 or starts is not None:  # one query at the end of equal rows sees every key
            scores = scores.masked_fill(~_query_mask(starts, 0, T, S, S - T, q.device), float("-inf"))
        if stats is not None:
            stats.add_max_logits(self, scores.detach().amax(dim=(0, 2, 3)))
        probs = scores.softmax(-1).to(q.dtype).view(B, nh * T, S)
        o_lat = torch.bmm(probs, c).view(B, nh, T, r).transpose(0, 1).reshape(nh, B * T, r)
        o = torch.bmm(o_lat, w_uv.transpose(1, 2))                       # [nh, B·T, v]
        return o.view(nh, B, T, self.v_head_dim).permute(1, 2, 0, 3)      # [B, T, nh, v]

    # ------------------------------------------------------------------ forward
    def forward(self, x: torch.Tensor, state: MLAState | None = None,
                stats: ForwardStats | None = None) -> torch.Tensor:
        """x [B,T,H] -> [B,T,H]; ``state`` (this layer's cache entry) gets the new c, k_pe appended;
        ``stats``: where the per-head max logits go when it asks for them (module docstring)."""
        self._check(x, state)
        B, T, _ = x.shape
        q = self._query(x)
        c, k_pe = self._latent(x)
        cached = state is not None and not state.is_empty
        starts = None                      # rows of different lengths: each masked at its own
        if state is not None:
            if not state.uniform:
                starts = state.lengths.to(x.device)
            c, k_pe = state.append(c, k_pe)
        impl = self.attn_impl
        if impl == "auto":
            impl = "absorb" if cached and T <= self.absorb_max_tokens else "naive"
        measure = stats if stats is not None and stats.measure_max_logits else None
        o = (self._absorb if impl == "absorb" else self._naive)(q, c, k_pe, starts, measure)  # [B,T,nh,v]
        if self.use_output_gate:
            o = o * torch.sigmoid(self.g_proj(x)).view(B, T, self.num_heads, self.v_head_dim)
        return self.o_proj(o.reshape(B, T, self.num_heads * self.v_head_dim))

    def extra_repr(self) -> str:
        return (f"layer_idx={self.layer_idx}, num_heads={self.num_heads}, q_lora_rank={self.q_lora_rank}, "
                f"kv_lora_rank={self.kv_lora_rank}, output_gate={self.use_output_gate}, "
                f"attn_impl={self.attn_impl!r}")
