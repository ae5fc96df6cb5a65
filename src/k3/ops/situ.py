"""Gated activations (SPEC §3.4): SiTU, and SwiGLU for Kimi-Linear mode.

    situ_glu(g, u) = [β·tanh(g/β)·sigmoid(g)] · [β_lin·tanh(u/β_lin)]
    swiglu(g, u)   = SiLU(g)·u

β = activation_situ_beta (4), β_lin = activation_situ_linear_beta (25; None → u unchanged).
Both SiTU factors are bounded, so the product stays finite for any input (unlike SwiGLU); it is
computed in fp32 and cast back to the input dtype. ``situ_glu`` and ``swiglu`` are the torch forms.
``gated_act`` (what ``glu_act`` returns) runs fp32 CPU inputs through one C call forward and one
backward (``k3::gated_act``, ``glu.c``: the gradients fused, computed from g and u alone, which are
all it keeps) instead of autograd's chain of a dozen elementwise kernels; elsewhere, or where the CPU
kernels cannot be built, the torch forms. The two agree to fp32 rounding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from k3.ops import cpu_kernels
from k3.ops.backend import use_c

__all__ = ["situ_glu", "swiglu", "gated_act", "glu_act"]


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


def gated_act(g: torch.Tensor, u: torch.Tensor, silu: bool, beta: float = 4.0,
              linear_beta: float | None = 25.0) -> torch.Tensor:
    """``swiglu(g, u)`` when ``silu`` else ``situ_glu(g, u, beta, linear_beta)``; g, u [..., F]."""
    if g.shape != u.shape:
        raise ValueError(f"gated_act: g and u must have one shape, got {tuple(g.shape)} and {tuple(u.shape)}")
    if use_c("gated_act", g.device.type == "cpu" and g.dtype == u.dtype == torch.float32 and g.numel() > 0):
        if not silu and not beta > 0:
            raise ValueError(f"gated_act: SiTU needs beta > 0, got {beta}")
        return _glu_op(g.contiguous(), u.contiguous(), silu, float(beta),
                       0.0 if silu or linear_beta is None else float(linear_beta))
    return swiglu(g, u) if silu else situ_glu(g, u, beta, linear_beta)


def glu_act(config) -> "callable":
    """The gated activation a config asks for, as ``f(gate, up)``."""
    if config.hidden_act == "silu":
        return lambda g, u: gated_act(g, u, True)
    beta, lin = config.activation_situ_beta, config.activation_situ_linear_beta
    return lambda g, u: gated_act(g, u, False, beta, lin)


def _check_glu(op: str, g: torch.Tensor, u: torch.Tensor, linear_beta: float, **more) -> None:
    cpu_kernels.check_dense(op, g=(g, g.shape), u=(u, g.shape), **{k: (t, g.shape) for k, t in more.items()})
    if linear_beta < 0:
        raise ValueError(f"{op}: linear_beta must be > 0 (or 0 for none), got {linear_beta}")


@torch.library.custom_op("k3::gated_act", mutates_args=(), device_types="cpu")
def _glu_op(g: torch.Tensor, u: torch.Tensor, silu: bool, beta: float, linear_beta: float) -> torch.Tensor:
    """y = the gated activation of g, u (contiguous fp32, one shape); linear_beta 0: SiTU's up is u."""
    _check_glu("k3::gated_act", g, u, linear_beta)
    y = torch.empty(g.shape)
    cpu_kernels.library().k3_glu(g.numel(), g.data_ptr(), u.data_ptr(), int(silu), beta, linear_beta,
                                 y.data_ptr(), torch.get_num_threads())
    return y


@_glu_op.register_fake
def _(g, u, silu, beta, linear_beta):
    return g.new_empty(g.shape)


@torch.library.custom_op("k3::gated_act_backward", mutates_args=(), device_types="cpu")
def _glu_bwd_op(g: torch.Tensor, u: torch.Tensor, dy: torch.Tensor, silu: bool, beta: float,
                linear_beta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(dg, du) of the gated activation at g, u for the output gradient dy (all contiguous fp32)."""
    _check_glu("k3::gated_act_backward", g, u, linear_beta, dy=dy)
    dg, du = torch.empty(g.shape), torch.empty(g.shape)
    cpu_kernels.library().k3_glu_bwd(g.numel(), g.data_ptr(), u.data_ptr(), dy.data_ptr(), int(silu), beta,
                                     linear_beta, dg.data_ptr(), du.data_ptr(), torch.get_num_threads())
    return dg, du


@_glu_bwd_op.register_fake
def _(g, u, dy, silu, beta, linear_beta):
    return g.new_empty(g.shape), g.new_empty(g.shape)


def _glu_setup(ctx, inputs, output):
    g, u, ctx.silu, ctx.beta, ctx.linear_beta = inputs
    ctx.save_for_backward(g, u)


def _glu_backward(ctx, dy):
    g, u = ctx.saved_tensors
    dg, du = _glu_bwd_op(g, u, dy.float().contiguous(), ctx.silu, ctx.beta, ctx.linear_beta)
    return dg, du, None, None, None


_glu_op.register_autograd(_glu_backward, setup_context=_glu_setup)
