"""Stable LatentMoE (SPEC §3.5): sigmoid router on the full hidden, routed experts in a latent.

Shapes: N tokens (B·T flattened), H hidden, E experts, k experts per token, ℓ expert width
(routed_expert_hidden_size, or H in plain MoE), F = moe_intermediate_size, S = N·k token-slots,
C = per-expert capacity.

    p, idx = route(x)                          router in fp32, selection-only bias (ops/routing.py)
    z      = routed_expert_down_proj(x)        [N, ℓ]    (plain MoE: z = x)
    u      = Σ_k p_k · expert_{idx_k}(z)       [N, ℓ]
    y      = routed_expert_up_proj(RMSNorm(u)) [N, H]    (norm only if latent_moe_use_norm)
    out    = y + shared_experts(x)

Dispatch (dropless, training and inference): sort the S slots by expert, run the experts as grouped
matmuls over contiguous per-expert row blocks (`torch.nn.functional.grouped_mm`), scale by p and
scatter back with one `index_add_`. The capacity path (`capacity_factor`) packs the slots into a
static [E, C, ℓ] buffer instead, the layout expert parallelism exchanges; slots past an expert's
capacity (in sorted order: lower token index wins) are dropped and contribute nothing, with the
surviving weights left as routed (not renormalized).

`RoutedExperts` is the seam for QAT / packed MXFP4: replace the module or override
`expert_weights()`; both dispatch paths fetch their weights only through it.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from k3.model.mlp import GatedMLP
from k3.model.norm import RMSNorm
from k3.model.stats import ForwardStats
from k3.ops.routing import route_topk
from k3.ops.situ import glu_act

__all__ = ["MoEGate", "RoutedExperts", "LatentMoE", "grouped_linear"]


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the incoming gradient contiguous (grouped_mm needs it)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g.contiguous()


def grouped_linear(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Per-group x @ w[e]^T. x [S, in], w [E, out, in], offs [E] int32 cumulative ends -> [S, out].

    Rows offs[e-1]:offs[e] use w[e]; offs[-1] must equal S (rows past it would be left unwritten).
    grouped_mm needs 16-byte aligned strides, so odd widths are zero-padded (exact, a copy).
    Autocast does not cover grouped_mm on CPU, so the autocast dtype is applied here.
    """
    dev = x.device.type
    if torch.is_autocast_enabled(dev):
        dt = torch.get_autocast_dtype(dev)
        x, w = x.to(dt), w.to(dt)
    elif w.dtype != x.dtype:
        w = w.to(x.dtype)
    out_f, in_f = w.shape[1], w.shape[2]
    if x.device.type == "cpu" and not torch.is_grad_enabled():
        # CPU inference (decode: few rows, most experts idle): one mm per non-empty group instead of
        # grouped_mm's fallback loop over every group; same products.
        y, start = x.new_empty(x.shape[0], out_f), 0
        for e, end in enumerate(offs.tolist()):
            if end > start:
                torch.mm(x[start:end], w[e].t(), out=y[start:end])
            start = end
        return y
    align = max(1, 16 // x.element_size())
    pad_o, pad_i = (-out_f) % align, (-in_f) % align
    if pad_o or pad_i:
        x = F.pad(x, (0, pad_i))
        w = F.pad(w, (0, pad_i, 0, pad_o))
    y = F.grouped_mm(_ContiguousGrad.apply(x.contiguous()), w.transpose(-2, -1), offs=offs)
    y = _ContiguousGrad.apply(y)
    return y[:, :out_f] if pad_o else y


class MoEGate(nn.Module):
    """Router: `weight` [E, H] and the fp32 selection bias `e_score_correction_bias` [E]."""

    def __init__(self, config):
        super().__init__()
        self.num_experts = config.num_experts
        self.top_k = config.num_experts_per_token
        self.activation = config.moe_router_activation_func
        self.renormalize = config.moe_renormalize
        self.scaling = config.routed_scaling_factor
        self.num_groups = config.num_expert_group
        self.topk_group = config.topk_group
        self.weight = nn.Parameter(torch.empty(config.num_experts, config.hidden_size))
        self.register_buffer("e_score_correction_bias", torch.zeros(config.num_experts), persistent=True)
        self.init_std = config.initializer_range
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """weight ~ N(0, initializer_range); selection bias 0 (balancing moves it from step 1)."""
        nn.init.normal_(self.weight, 0.0, self.init_std)
        self.e_score_correction_bias.zero_()

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [N, H] -> (weights [N, k] fp32, indices [N, k] int64, scores [N, E] fp32)."""
        with torch.autocast(x.device.type, enabled=False):
            logits = F.linear(x.float(), self.weight.float())
        return route_topk(logits, self.e_score_correction_bias, self.top_k, self.activation,
                          self.renormalize, self.scaling, self.num_groups, self.topk_group)

    def _apply(self, fn, recurse=True):
        # The bias stays fp32 under model.to(bf16): bf16 would round small corrections away.
        bias = self.e_score_correction_bias
        super()._apply(fn, recurse)
        new = self.e_score_correction_bias
        if new.dtype != torch.float32:
            keep = new.float() if bias.is_meta else bias.to(device=new.device, dtype=torch.float32)
            self.e_score_correction_bias = keep
        return self


class RoutedExperts(nn.Module):
    """E gated experts stacked: w1 (gate) [E,F,ℓ], w3 (up) [E,F,ℓ], w2 (down) [E,ℓ,F] (Linear layout)."""

    def __init__(self, num_experts: int, dim: int, intermediate: int, act, init_std: float = 0.02):
        super().__init__()
        self.num_experts, self.dim, self.intermediate = num_experts, dim, intermediate
        self.act = act
        self.w1 = nn.Parameter(torch.empty(num_experts, intermediate, dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, intermediate, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, intermediate))
        self.init_std = init_std
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """w1, w3, w2 ~ N(0, init_std)."""
        for w in (self.w1, self.w3, self.w2):
            nn.init.normal_(w, 0.0, self.init_std)

    def expert_weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(w1, w3, w2) as used by the forward; a QAT pass overrides this to fake-quantize."""
        return self.w1, self.w3, self.w2

    def forward(self, x_sorted: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """x_sorted [S, ℓ] grouped by expert, offsets [E] int32 cumulative ends -> [S, ℓ]."""
        w1, w3, w2 = self.expert_weights()
        h = self.act(grouped_linear(x_sorted, w1, offsets), grouped_linear(x_sorted, w3, offsets))
        return grouped_linear(h, w2, offsets)

    def forward_capacity(self, x_ECD: torch.Tensor) -> torch.Tensor:
        """Static-shape form: x [E, C, ℓ] (expert e's slots in row e) -> [E, C, ℓ]."""
        w1, w3, w2 = self.expert_weights()
        w1, w3, w2 = (w.to(x_ECD.dtype) for w in (w1, w3, w2))
        h = self.act(torch.bmm(x_ECD, w1.transpose(1, 2)), torch.bmm(x_ECD, w3.transpose(1, 2)))
        return torch.bmm(h, w2.transpose(1, 2))

    def extra_repr(self) -> str:
        return f"num_experts={self.num_experts}, dim={self.dim}, intermediate={self.intermediate}"


class LatentMoE(nn.Module):
    """The MoE block (`block_sparse_moe`). Call: x [..., H] -> [..., H].

    capacity_factor None → dropless sort + grouped_mm dispatch; a float → static [E, C, ℓ] buffers
    with C = ceil(capacity_factor · N·k / E) (see module docstring for dropped slots).
    Given ``stats`` (:class:`k3.model.stats.ForwardStats`) the forward adds its router statistics:
    detached scores [N, E], slots routed per expert [E] (before any capacity drop) and, on the
    capacity path, the dropped slots. The layer never changes its own bias: the trainer reads the
    statistics and writes `gate.e_score_correction_bias` (Quantile Balancing / sign update,
    :class:`k3.train.balance.RouterBalancer`).
    """

    def __init__(self, config, capacity_factor: float | None = None):
        super().__init__()
        if config.num_experts <= 0:
            raise ValueError("LatentMoE needs num_experts > 0")
        self.hidden_size = config.hidden_size
        self.num_experts = config.num_experts
        self.top_k = config.num_experts_per_token
        self.latent = config.uses_latent_moe
        self.expert_dim = config.expert_dim
        self.capacity_factor = capacity_factor
        # Pluggable dispatch: ``dispatcher(moe, z, weights, indices) -> (u [N, ℓ] fp32, dropped slots
        # int | None)`` replaces the local paths (expert parallelism, k3.train.distributed); None:
        # the paths below.
        self.dispatcher = None
        std = config.initializer_range
        self.gate = MoEGate(config)
        if self.latent:
            self.routed_expert_down_proj = nn.Linear(config.hidden_size, self.expert_dim, bias=False)
            if config.latent_moe_use_norm:
                self.routed_expert_norm = RMSNorm(self.expert_dim, eps=config.rms_norm_eps)
            self.routed_expert_up_proj = nn.Linear(self.expert_dim, config.hidden_size, bias=False)
        self.init_std = std
        self.reset_parameters()
        self.experts = RoutedExperts(config.num_experts, self.expert_dim, config.moe_intermediate_size,
                                     glu_act(config), init_std=std)
        if config.num_shared_experts > 0:
            self.shared_experts = GatedMLP(config.hidden_size,
                                           config.num_shared_experts * config.moe_intermediate_size, config)
        self._flops = self._count_flops(config)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Latent projections ~ N(0, initializer_range); gate, experts, norm and shared experts
        initialise themselves (their own ``reset_parameters``)."""
        if self.latent:
            nn.init.normal_(self.routed_expert_down_proj.weight, 0.0, self.init_std)
            nn.init.normal_(self.routed_expert_up_proj.weight, 0.0, self.init_std)

    # ------------------------------------------------------------------ forward
    def forward(self, x: torch.Tensor, stats: ForwardStats | None = None) -> torch.Tensor:
        """x [..., H] -> [..., H]; ``stats``: where the router statistics go (None: not measured)."""
        if x.shape[-1] != self.hidden_size:
            raise ValueError(f"LatentMoE expected hidden size {self.hidden_size} in the last dimension, "
                             f"got input shape {tuple(x.shape)}")
        shape = x.shape
        x2 = x.reshape(-1, self.hidden_size)
        weights, indices, scores = self.gate(x2)
        z = self.routed_expert_down_proj(x2) if self.latent else x2
        if self.dispatcher is not None:
            u, dropped = self.dispatcher(self, z, weights, indices)
        elif self.capacity_factor is None:
            u, dropped = self._dispatch_sorted(z, weights, indices), None
        else:
            u, dropped = self._dispatch_capacity(z, weights, indices, self.capacity_factor)
        if stats is not None:
            stats.add_router(self, scores.detach(),
                             torch.bincount(indices.reshape(-1), minlength=self.num_experts), dropped)
        y = self._routed_output(u, z, x2)
        if hasattr(self, "shared_experts"):
            y = y + self.shared_experts(x2)
        return y.reshape(shape)

    def _routed_output(self, u: torch.Tensor, z: torch.Tensor, x2: torch.Tensor) -> torch.Tensor:
        """Combined expert outputs u -> the routed part in model width (latent: norm + up-projection)."""
        if not self.latent:
            return u.to(x2.dtype)
        if hasattr(self, "routed_expert_norm"):
            u = self.routed_expert_norm(u)
        return self.routed_expert_up_proj(u.to(z.dtype))

    @staticmethod
    def _sort_slots(indices: torch.Tensor, num_experts: int):
        """indices [N, k] -> (order [S] slot ids sorted by expert, token of each sorted slot, counts [E])."""
        flat = indices.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=num_experts)
        return order, order // indices.shape[1], counts

    def _dispatch_sorted(self, z: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        """z [N, ℓ] -> u [N, ℓ] fp32 = Σ_k p_k expert_k(z), dropless."""
        order, token, counts = self._sort_slots(indices, self.num_experts)
        offsets = counts.cumsum(0).to(torch.int32)
        ys = self.experts(z.index_select(0, token), offsets)                 # [S, ℓ]
        ys = ys.float() * weights.reshape(-1).index_select(0, order).unsqueeze(-1)
        return torch.zeros(z.shape[0], ys.shape[-1], dtype=ys.dtype, device=z.device).index_add_(0, token, ys)

    def capacity(self, num_tokens: int, capacity_factor: float) -> int:
        """C = ceil(capacity_factor · N·k / E), at least 1."""
        return max(1, math.ceil(capacity_factor * num_tokens * self.top_k / self.num_experts))

    def _dispatch_capacity(self, z: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor,
                           capacity_factor: float) -> tuple[torch.Tensor, int]:
        """Static-shape dispatch through an [E, C, ℓ] buffer; slots past capacity are dropped.
        Returns (u [N, ℓ] fp32, dropped slots)."""
        n, d = z.shape
        e = self.num_experts
        cap = self.capacity(n, capacity_factor)
        buf, slot, token_k, p = self._capacity_pack(z, weights, indices, cap)
        rows = self.experts.forward_capacity(buf.view(e, cap, d)).reshape(e * cap, d)
        return self._capacity_combine(rows, slot, token_k, p, n), indices.numel() - slot.numel()

    def _capacity_pack(self, z: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor, cap: int):
        """Slots -> a zero-padded [E·C, ℓ] buffer (expert e's slots in rows e·C …, in token order; slots
        past capacity C dropped: ``indices.numel() - slot.numel()`` of them). Returns (buffer, slot rows
        [S'], their tokens [S'], their routing weights [S']) — also the expert-parallel send buffer."""
        e = self.num_experts
        order, token, counts = self._sort_slots(indices, e)
        expert = indices.reshape(-1).index_select(0, order)                  # [S] sorted expert ids
        starts = counts.cumsum(0) - counts
        pos = torch.arange(order.numel(), device=z.device) - starts.index_select(0, expert)
        keep = pos < cap
        slot = (expert * cap + pos)[keep]                                    # row in the [E·C] buffer
        token_k = token[keep]
        buf = torch.zeros(e * cap, z.shape[1], dtype=z.dtype, device=z.device)
        buf = buf.index_copy(0, slot, z.index_select(0, token_k))
        return buf, slot, token_k, weights.reshape(-1).index_select(0, order)[keep]

    @staticmethod
    def _capacity_combine(rows: torch.Tensor, slot: torch.Tensor, token_k: torch.Tensor, p: torch.Tensor,
                          n: int) -> torch.Tensor:
        """Expert outputs at the [E·C, ℓ] buffer's rows -> [n, ℓ] fp32: u_t = Σ p_slot · rows[slot]."""
        ys = rows.index_select(0, slot).float() * p.unsqueeze(-1)
        return torch.zeros(n, rows.shape[1], dtype=ys.dtype, device=rows.device).index_add_(0, token_k, ys)

    # ---------------------------------------------------------------- accounting
    def _count_flops(self, config) -> int:
        h, d, f, e = config.hidden_size, self.expert_dim, config.moe_intermediate_size, config.num_experts
        fl = 2 * h * e + 2 * self.top_k * 3 * d * f
        if self.latent:
            fl += 2 * 2 * h * d
        fl += 2 * 3 * h * config.num_shared_experts * f
        return fl

    def flops_per_token(self) -> int:
        """Forward matmul FLOPs per token (router, latent projections, k routed experts, shared)."""
        return self._flops
