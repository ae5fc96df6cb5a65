"""The two normalizations every layer shares (SPEC §3): RMSNorm and the per-head L2 norm.

    rms_norm(x; w, eps)  = w · x / sqrt(mean_D(x²) + eps)      (RMSNorm, learned weight w [D])
    l2_normalize(x; eps) = x / sqrt(Σ_D x² + eps)              (KDA's q, k per head, eps = 1e-6)

Both reduce over the last dim D, compute in fp32 and return x's dtype. Every RMSNorm in the model
(``k3.model.norm.RMSNorm``, the AttnRes key norm in :mod:`k3.ops.attn_res`, KDA's output norm)
calls ``rms_norm``; KDA's q/k normalization calls ``l2_normalize``.
"""

from __future__ import annotations

import torch

__all__ = ["rms_norm", "l2_normalize", "inv_rms", "inv_sumsq"]


def inv_rms(x: torch.Tensor, eps: float, keepdim: bool = False) -> torch.Tensor:
    """x [..., D] fp32 -> 1 / sqrt(mean_D(x²) + eps), [...] (or [..., 1] with keepdim); written in
    place on its own fresh intermediate (the inference paths' form)."""
    return x.pow(2).mean(-1, keepdim=keepdim).add_(eps).rsqrt_()


def inv_sumsq(x: torch.Tensor, c: torch.Tensor, keepdim: bool = True) -> torch.Tensor:
    """x [..., D] fp32, c a 0-dim tensor -> 1 / sqrt(Σ_D x² + c), [..., 1] (or [...]). With c = D·eps
    this is inv_rms(x, eps) / √D: the decode step's form, whose √D lives in the next weight."""
    n = torch.linalg.vector_norm(x, dim=-1, keepdim=keepdim)
    return torch.addcmul(c, n, n).rsqrt_()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., D], weight [D] -> weight · x / sqrt(mean(x²) + eps) in x's dtype (fp32 compute)."""
    if x.dtype == weight.dtype == torch.float32 and not torch.is_grad_enabled():
        # inference, fp32: the same operations in place (bit-identical, fewer allocations)
        return torch.mul(x, inv_rms(x, eps, keepdim=True)).mul_(weight)
    x32 = x.float()
    y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.float() * y).to(x.dtype)


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x [..., D] -> x / sqrt(Σ x² + eps) over the last dim in x's dtype (fp32 compute)."""
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).sum(-1, keepdim=True) + eps)).to(x.dtype)
