"""SiTU gated activation (SPEC §3.4).

    situ_glu(g, u) = [β·tanh(g/β)·sigmoid(g)] · [β_lin·tanh(u/β_lin)]

β = activation_situ_beta (4), β_lin = activation_situ_linear_beta (25; None → u unchanged).
Both factors are bounded, so the product stays finite for any input (unlike SwiGLU). Computed in
fp32 and cast back to the input dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["situ_glu", "swiglu", "glu_act"]


def situ_glu(g: torch.Tensor, u: torch.Tensor, beta: float = 4.0, linear_beta: float | None = 25.0) -> torch.Tensor:
    """g, u: [..., F] gate and up projections -> [..., F]."""
    dtype = g.dtype
    g32, u32 = g.float(), u.float()
    gate = beta * torch.tanh(g32 / beta) * torch.sigmoid(g32)
    up = u32 if linear_beta is None else linear_beta * torch.tanh(u32 / linear_beta)
    return (gate * up).to(dtype)


def swiglu(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """SiLU(g)·u, the Kimi-Linear / DeepSeek activation (hidden_act='silu')."""
    return F.silu(g) * u


def glu_act(config) -> "callable":
    """The gated activation a config asks for, as ``f(gate, up)``."""
    if config.hidden_act == "silu":
        return swiglu
    beta, lin = config.activation_situ_beta, config.activation_situ_linear_beta
    return lambda g, u: situ_glu(g, u, beta, lin)
