"""Inference-only fused projections: several ``nn.Linear`` layers that read the same input run as
one matmul over their weights stacked by rows (decode is bound by per-call overhead, not FLOPs).

    y = x @ cat([W_1; …; W_n])ᵀ  ->  split into [x W_1ᵀ | … | x W_nᵀ]      (exactly the n products)

The stacked weight is a copy cached on the owner module (a plain attribute: never a parameter,
never in the state dict) and rebuilt whenever any source weight changes: the cache key is every
source's ``(data_ptr, _version, dtype)``, so an optimizer step, ``load_state_dict`` or ``.to()``
invalidates it. Only used under ``torch.no_grad()`` (the copy carries no gradient).
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["fused_linear", "plain_linears"]


def _stacked(owner, weights: tuple[torch.Tensor, ...], tag: str) -> torch.Tensor:
    key = tuple((w.data_ptr(), w._version, w.dtype) for w in weights)
    cache = owner.__dict__.setdefault("_k3_fused", {})
    hit = cache.get(tag)
    if hit is None or hit[0] != key:
        hit = (key, torch.cat([w.detach() for w in weights], 0))
        cache[tag] = hit
    return hit[1]


def fused_linear(owner, x: torch.Tensor, weights: tuple[torch.Tensor, ...], tag: str) -> list[torch.Tensor]:
    """[x @ W_iᵀ for W_i in weights] with one matmul; ``tag`` names this group on ``owner``."""
    w = _stacked(owner, weights, tag)
    return list(torch.mm(x, w.t()).split([wi.shape[0] for wi in weights], dim=-1))


def plain_linears(*mods) -> bool:
    """Every module is exactly a bias-free ``nn.Linear`` (a replaced or quantized layer is called
    as itself instead) and fusing is allowed (no gradient is being recorded)."""
    return not torch.is_grad_enabled() and all(type(m) is nn.Linear and m.bias is None for m in mods)
