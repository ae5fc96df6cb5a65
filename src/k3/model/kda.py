"""Kimi Delta Attention layer (SPEC §3.1).

Per token t, with P = nh·d channels split into nh heads of size d::

    q, k, v = SiLU(conv_q(q_proj x)), SiLU(conv_k(k_proj x)), SiLU(conv_v(v_proj x))   depthwise causal, kernel K
    q, k    = q / ||q||, k / ||k||                                  per head (scale d^-0.5 applied by the op)
    g       = lb · sigmoid(exp(A_log) · (f_b_proj(f_a_proj x) + dt_bias))       lb = gate_lower_bound
            | −exp(A_log) · softplus(f_b_proj(f_a_proj x) + dt_bias)            gate_lower_bound None
    beta    = sigmoid(b_proj x)                                     one per head
    S_t     = diag(exp g_t) S_{t−1} + beta_t k_t (v_t − (diag(exp g_t) S_{t−1})ᵀ k_t)ᵀ,   o_t = S_tᵀ q_t
    out     = o_proj( RMSNorm_d(o; o_norm) ⊙ sigmoid(g_proj x | g_b_proj(g_a_proj x)) )

The recurrence lives in :mod:`k3.ops.kda` (``chunk_kda`` for T > 1 and training, ``recurrent_kda``
for single-token decode). With a :class:`~k3.model.cache.KDAState` the conv continues from the
cached last K−1 inputs and the recurrence from the cached S, so prefill + decode equals one pass.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from k3.config import K3Config
from k3.model.cache import KDAState, check_layer_call
from k3.model.norm import RMSNorm
from k3.ops.kda import chunk_kda, kda_gate, recurrent_kda
from k3.ops.norm import l2_normalize
from k3.ops.short_conv import short_conv_silu

__all__ = ["KimiDeltaAttention"]


class KimiDeltaAttention(nn.Module):
    """KDA token mixer. ``forward(x [B,T,H], state: KDAState | None = None) -> [B,T,H]``.

    ``A_log`` [nh] and ``dt_bias`` [P] are fp32 parameters and stay fp32 when the module is cast
    (``model.to(torch.bfloat16)``): ``_apply`` puts the original fp32 values back after any cast
    to a narrower float type, so the decay is always computed from full-precision values.
    """

    _FP32_PARAMS = ("A_log", "dt_bias")

    def __init__(self, config: K3Config, layer_idx: int):
        super().__init__()
        lac = config.linear_attn_config
        self.layer_idx = layer_idx
        self.hidden_size = H = config.hidden_size
        self.num_heads, self.head_dim = nh, d = lac.num_heads, lac.head_dim
        self.conv_kernel_size = K = lac.short_conv_kernel_size
        self.gate_lower_bound = lac.gate_lower_bound
        self.use_full_rank_gate = lac.use_full_rank_gate
        self.initializer_range = config.initializer_range
        P = nh * d

        self.q_proj = nn.Linear(H, P, bias=False)
        self.k_proj = nn.Linear(H, P, bias=False)
        self.v_proj = nn.Linear(H, P, bias=False)
        self.q_conv1d = nn.Conv1d(P, P, K, groups=P, bias=False)  # weight [P, 1, K]
        self.k_conv1d = nn.Conv1d(P, P, K, groups=P, bias=False)
        self.v_conv1d = nn.Conv1d(P, P, K, groups=P, bias=False)
        self.f_a_proj = nn.Linear(H, d, bias=False)
        self.f_b_proj = nn.Linear(d, P, bias=False)
        self.A_log = nn.Parameter(torch.empty(nh, dtype=torch.float32))
        self.dt_bias = nn.Parameter(torch.empty(P, dtype=torch.float32))
        self.b_proj = nn.Linear(H, nh, bias=False)
        if self.use_full_rank_gate:
            self.g_proj = nn.Linear(H, P, bias=False)
        else:
            self.g_a_proj = nn.Linear(H, d, bias=False)
            self.g_b_proj = nn.Linear(d, P, bias=False)
        self.o_norm = RMSNorm(d, eps=config.rms_norm_eps)
        self.o_proj = nn.Linear(P, H, bias=False)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Kimi Linear / fla init: Linear ~ N(0, initializer_range), convs as nn.Conv1d,
        A_log = log U(1, 16), dt_bias = softplus⁻¹(dt) with dt log-uniform in [1e-3, 1e-1]."""
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, mean=0.0, std=self.initializer_range)
            elif isinstance(m, nn.Conv1d):
                m.reset_parameters()
        self.A_log.copy_(torch.empty_like(self.A_log).uniform_(1.0, 16.0).log())
        dt = torch.empty_like(self.dt_bias).uniform_(math.log(1e-3), math.log(1e-1)).exp().clamp_min(1e-4)
        self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))  # stable inverse softplus
        nn.init.ones_(self.o_norm.weight)

    def _apply(self, fn, recurse=True):
        before = {n: getattr(self, n).data for n in self._FP32_PARAMS}
        out = super()._apply(fn, recurse)
        for n, old in before.items():
            p = getattr(self, n)
            if p.is_floating_point() and torch.finfo(p.dtype).bits < 32:
                p.data = (torch.empty_like(p, dtype=torch.float32) if old.is_meta and not p.is_meta
                          else old.to(device=p.device, dtype=torch.float32))
        return out

    # ------------------------------------------------------------------ forward
    def _check(self, x: torch.Tensor, state: KDAState | None) -> None:
        check_layer_call(self, x, state, KDAState, ("num_heads", "head_dim", "conv_kernel_size"))

    def _short_conv(self, qkv: torch.Tensor, state: KDAState | None) -> torch.Tensor:
        """SiLU(depthwise causal conv) of qkv [B,T,3P] (channels q|k|v) -> [B,T,3P].

        The three convs run as one grouped conv over the concatenated channels; the left context is
        the cached last K−1 inputs (zeros for a fresh sequence), and the new last K−1 are cached.
        """
        B, T, C = qkv.shape
        K = self.conv_kernel_size
        w = torch.cat([self.q_conv1d.weight, self.k_conv1d.weight, self.v_conv1d.weight], 0)[:, 0]  # [3P, K]
        prev = state.conv if state is not None else None
        if prev is not None:
            prev = prev.to(qkv.dtype)
        if state is not None:
            ctx = qkv.new_zeros(B, C, K - 1) if prev is None else prev
            state.conv = torch.cat([ctx, qkv.transpose(1, 2)], -1)[..., T:].contiguous()   # the last K−1 inputs
        return short_conv_silu(qkv, w.to(qkv.dtype), prev)

    def forward(self, x: torch.Tensor, state: KDAState | None = None) -> torch.Tensor:
        """x [B,T,H] -> [B,T,H]; ``state`` (this layer's cache entry) is updated in place."""
        self._check(x, state)
        B, T, _ = x.shape
        nh, d = self.num_heads, self.head_dim
        qkv = self._short_conv(torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], -1), state)
        q, k, v = (t.reshape(B, T, nh, d) for t in qkv.split(nh * d, dim=-1))
        q, k = l2_normalize(q), l2_normalize(k)
        f = self.f_b_proj(self.f_a_proj(x)).view(B, T, nh, d)
        g = kda_gate(f, self.A_log, self.dt_bias, self.gate_lower_bound)
        beta = torch.sigmoid(self.b_proj(x).float())

        initial = state.recurrent if state is not None else None
        if state is not None and T == 1:
            o, final = recurrent_kda(q, k, v, g, beta, initial_state=initial, output_final_state=True)
        else:
            o, final = chunk_kda(q, k, v, g, beta, initial_state=initial, output_final_state=state is not None,
                                 g_lower_bound=self.gate_lower_bound)
        if state is not None:
            state.recurrent = final

        gate = self.g_proj(x) if self.use_full_rank_gate else self.g_b_proj(self.g_a_proj(x))
        o = self.o_norm(o.float()) * torch.sigmoid(gate.view(B, T, nh, d).float())
        return self.o_proj(o.to(x.dtype).reshape(B, T, nh * d))

    def extra_repr(self) -> str:
        return (f"layer_idx={self.layer_idx}, num_heads={self.num_heads}, head_dim={self.head_dim}, "
                f"gate_lower_bound={self.gate_lower_bound}, full_rank_gate={self.use_full_rank_gate}")
