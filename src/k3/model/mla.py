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

QK-Clip support: with ``record_max_logits = True`` each forward stores ``last_max_logits`` [nh] fp32,
the largest pre-softmax score s_ij = (q_i·k_j)·scale over the causal pairs of the batch, per head
(detached, computed under no_grad in query blocks; off by default, so inference pays nothing).
The trainer reads it (:class:`k3.train.optim.QKClip`) and rescales the weights after the step.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from k3.config import K3Config
from k3.model.cache import MLAState, check_layer_call
from k3.model.norm import RMSNorm

__all__ = ["GatedMLA", "ATTN_IMPLS"]

ATTN_IMPLS = ("naive", "absorb", "auto")


def _causal_mask(T: int, S: int, device: torch.device) -> torch.Tensor:
    """[T, S] bool, True where new query i (absolute position S−T+i) may attend key j."""
    return torch.arange(S, device=device)[None, :] <= torch.arange(S - T, S, device=device)[:, None]


class GatedMLA(nn.Module):
    """Gated MLA (NoPE). ``forward(x [B,T,H], state: MLAState | None = None) -> [B,T,H]``."""

    absorb_max_tokens = 16  # 'auto' absorbs when a cached sequence gets at most this many new tokens
    max_logit_block = 256   # query rows per block when measuring the max logits

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
        self.record_max_logits = False
        self.last_max_logits: torch.Tensor | None = None

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
    def _max_logits(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """q [B,nh,T,n+p], k [B,nh,S,n+p] (last T keys are the queries') -> per-head max score [nh] fp32."""
        T, S = q.shape[2], k.shape[2]
        best = q.new_full((q.shape[1],), float("-inf"), dtype=torch.float32)
        mask = _causal_mask(T, S, q.device)
        with torch.autocast(q.device.type, enabled=False):                    # fp32 scores
            for t0 in range(0, T, self.max_logit_block):
                qb = q[:, :, t0:t0 + self.max_logit_block].float()
                s = (qb @ k.float().transpose(-1, -2)) * self.softmax_scale      # [B, nh, tb, S]
                s = s.masked_fill(~mask[t0:t0 + qb.shape[2]], float("-inf"))
                best = torch.maximum(best, s.amax(dim=(0, 2, 3)))
        return best

    def _naive(self, q: torch.Tensor, c: torch.Tensor, k_pe: torch.Tensor) -> torch.Tensor:
        """q [B,T,nh,n+p], c [B,S,r], k_pe [B,S,p] (last T tokens are the queries) -> [B,T,nh,v]."""
        B, T, nh, _ = q.shape
        S = c.shape[1]
        k_nope, v = self.kv_b_proj(c).view(B, S, nh, -1).split([self.qk_nope_head_dim, self.v_head_dim], -1)
        k = torch.cat([k_nope, k_pe[:, :, None, :].expand(B, S, nh, self.qk_rope_head_dim)], -1)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, nh, ·, ·]
        if self.record_max_logits:
            self.last_max_logits = self._max_logits(q, k)
        if S == T:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.softmax_scale)
        else:
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=_causal_mask(T, S, q.device),
                                               scale=self.softmax_scale)
        return o.transpose(1, 2)

    def _absorb(self, q: torch.Tensor, c: torch.Tensor, k_pe: torch.Tensor) -> torch.Tensor:
        """Same contract as ``_naive``, attending over the latents (W_UK into q, W_UV onto the output)."""
        B, T, nh, _ = q.shape
        n = self.qk_nope_head_dim
        w = self.kv_b_proj.weight.view(nh, n + self.v_head_dim, self.kv_lora_rank)
        w_uk, w_uv = w[:, :n], w[:, n:]                                  # [nh, n, r], [nh, v, r]
        q_nope, q_pe = q.split([n, self.qk_rope_head_dim], -1)
        q_lat = torch.einsum("bthn,hnr->bthr", q_nope, w_uk)            # [B,T,nh,r]
        scores = (torch.einsum("bthr,bsr->bhts", q_lat, c)
                  + torch.einsum("bthp,bsp->bhts", q_pe, k_pe)).float() * self.softmax_scale
        scores = scores.masked_fill(~_causal_mask(T, c.shape[1], q.device), float("-inf"))
        if self.record_max_logits:
            self.last_max_logits = scores.detach().amax(dim=(0, 2, 3))
        probs = scores.softmax(-1).to(q.dtype)
        o_lat = torch.einsum("bhts,bsr->bthr", probs, c)                # [B,T,nh,r]
        return torch.einsum("bthr,hvr->bthv", o_lat, w_uv)

    # ------------------------------------------------------------------ forward
    def forward(self, x: torch.Tensor, state: MLAState | None = None) -> torch.Tensor:
        """x [B,T,H] -> [B,T,H]; ``state`` (this layer's cache entry) gets the new c, k_pe appended."""
        self._check(x, state)
        B, T, _ = x.shape
        q = self._query(x)
        c, k_pe = self._latent(x)
        cached = state is not None and not state.is_empty
        if state is not None:
            c, k_pe = state.append(c, k_pe)
        impl = self.attn_impl
        if impl == "auto":
            impl = "absorb" if cached and T <= self.absorb_max_tokens else "naive"
        o = (self._absorb if impl == "absorb" else self._naive)(q, c, k_pe)  # [B,T,nh,v]
        if self.use_output_gate:
            o = o * torch.sigmoid(self.g_proj(x)).view(B, T, self.num_heads, self.v_head_dim)
        return self.o_proj(o.reshape(B, T, self.num_heads * self.v_head_dim))

    def extra_repr(self) -> str:
        return (f"layer_idx={self.layer_idx}, num_heads={self.num_heads}, q_lora_rank={self.q_lora_rank}, "
                f"kv_lora_rank={self.kv_lora_rank}, output_gate={self.use_output_gate}, "
                f"attn_impl={self.attn_impl!r}")
