"""RMSNorm module (fp32 compute, learned weight); the math is :func:`k3.ops.norm.rms_norm`."""

from __future__ import annotations

import torch
from torch import nn

from k3.ops.norm import rms_norm

__all__ = ["RMSNorm", "rms_norm"]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    @torch.no_grad()
    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"
