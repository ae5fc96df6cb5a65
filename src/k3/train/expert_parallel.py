"""Expert parallelism (SPEC §5): each of the ep ranks of a group holds E/ep experts; tokens travel
to their experts and back with ``all_to_all_single`` over fixed-capacity buffers.

Shapes (one MoE layer, one rank): N local tokens, E experts, k per token, P = ep ranks, E_l = E/P
local experts (rank p holds experts p·E_l … (p+1)·E_l − 1), ℓ expert width, C capacity::

    C      = N                          capacity_factor None: a token picks an expert at most once,
                                        so no slot can overflow (static, dropless, E/k x the work)
           = min(N, ceil(f · N·k / E))  capacity_factor f: slots past C (lower token index wins,
                                        as in LatentMoE's capacity path) are dropped and counted
    send   [E, C, ℓ]  = [P, E_l, C, ℓ]  slot (e, c) holds the c-th token this rank routes to e
    recv   [P, E_l, C, ℓ]               block p: what rank p sent to my experts
    y      = experts(recv as [E_l, P·C, ℓ])                    (bmm, static shapes)
    back   = all_to_all(y as [P, E_l, C, ℓ])  -> [E, C, ℓ]     my slots, processed
    u_t    = Σ_k p_tk · back[slot of (t, k)]                   (dropped slots contribute nothing)

Every buffer has the same shape on every rank and every step (for a given N), so NCCL and gloo
see static collectives. The exchange is differentiable: the adjoint of an equal-split all-to-all
(a block permutation) is the same all-to-all, so backward sends the gradients the same way.
Bytes leaving a rank per layer and micro-batch: 2 (forward: dispatch + combine) + 2 (backward)
exchanges of E·C·ℓ elements, of which the fraction (P − 1)/P goes to other ranks.
"""

from __future__ import annotations

import math
import time

import torch
import torch.distributed as dist

__all__ = ["ExpertParallel", "CommStats", "ep_capacity", "all_to_all", "shard_experts"]


class CommStats:
    """Bytes sent to other ranks and seconds spent in the collectives this module issues."""

    def __init__(self):
        self.bytes = 0
        self.seconds = 0.0
        self.calls = 0

    def reset(self) -> None:
        self.bytes, self.seconds, self.calls = 0, 0.0, 0

    def add(self, nbytes: int, seconds: float) -> None:
        self.bytes += nbytes
        self.seconds += seconds
        self.calls += 1


class _AllToAll(torch.autograd.Function):
    """Equal-split ``all_to_all_single`` over dim 0; backward is the same exchange of the grads."""

    @staticmethod
    def forward(ctx, x, group, stats):
        ctx.group, ctx.stats = group, stats
        return _exchange(x, group, stats)

    @staticmethod
    def backward(ctx, g):
        return _exchange(g, ctx.group, ctx.stats), None, None


def _exchange(x: torch.Tensor, group, stats: CommStats | None) -> torch.Tensor:
    x = x.contiguous()
    out = torch.empty_like(x)
    t0 = time.perf_counter()
    dist.all_to_all_single(out, x, group=group)
    if stats is not None:
        p = dist.get_world_size(group)
        stats.add(x.numel() * x.element_size() * (p - 1) // p, time.perf_counter() - t0)
    return out


def all_to_all(x: torch.Tensor, group=None, stats: CommStats | None = None) -> torch.Tensor:
    """Differentiable equal-split all-to-all: dim 0 of x is cut in P blocks, block j goes to rank j."""
    return _AllToAll.apply(x, group, stats)


def ep_capacity(num_tokens: int, num_experts: int, top_k: int, capacity_factor: float | None) -> int:
    """Slots per (sending rank, expert): N when capacity_factor is None, else min(N, ceil(f·N·k/E))."""
    if capacity_factor is None:
        return max(1, num_tokens)
    return max(1, min(num_tokens, math.ceil(capacity_factor * num_tokens * top_k / num_experts)))


class ExpertParallel:
    """The dispatcher a LatentMoE calls (``moe.dispatcher``) when its experts are spread over ``group``.

    ``moe.experts`` must hold this rank's E/P experts (``shard_experts``). Call:
    ``(moe, z [N, ℓ], weights [N, k] fp32, indices [N, k]) -> (u [N, ℓ] fp32, dropped slots)``
    (the MoE puts the dropped count into its router statistics when the forward measures them).
    """

    def __init__(self, group, capacity_factor: float | None, stats: CommStats | None = None):
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.capacity_factor = capacity_factor
        self.stats = stats

    def __call__(self, moe, z: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        n, d = z.shape
        e, k, p = moe.num_experts, indices.shape[1], self.size
        el = e // p
        cap = ep_capacity(n, e, k, self.capacity_factor)
        send, slot, token_k, w = moe._capacity_pack(z, weights, indices, cap)   # [E·C, ℓ]
        recv = all_to_all(send, self.group, self.stats)                     # [P·E_l·C, ℓ]
        x = recv.view(p, el, cap, d).transpose(0, 1).reshape(el, p * cap, d)
        y = moe.experts.forward_capacity(x)                                 # [E_l, P·C, ℓ]
        y = y.view(el, p, cap, d).transpose(0, 1).reshape(e * cap, d)
        back = all_to_all(y, self.group, self.stats)
        return moe._capacity_combine(back, slot, token_k, w, n), indices.numel() - slot.numel()


@torch.no_grad()
def shard_experts(moe, ep_rank: int, ep_size: int) -> None:
    """Keep experts ep_rank·E/P … of ``moe.experts`` (w1, w2, w3 become [E/P, …] parameters)."""
    ex = moe.experts
    el = moe.num_experts // ep_size
    lo = ep_rank * el
    for name in ("w1", "w2", "w3"):
        full = getattr(ex, name)
        setattr(ex, name, torch.nn.Parameter(full.detach()[lo:lo + el].clone()))
    ex.num_experts = el
