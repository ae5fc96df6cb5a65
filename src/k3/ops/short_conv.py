"""KDA's short convolution (SPEC §3.1): SiLU of a causal depthwise conv of width K over time.

    z[b, t, c] = Σ_k w[c, k] · xx[b, t − (K−1) + k, c],   y = SiLU(z)

where xx is x [B, T, C] with the left context prev [B, C, K−1] before it (zeros when None). On the
CPU with fp32 inputs this is one C call forward and one backward (``k3::short_conv_silu``,
``short_conv.c``: channels-last, no transposed copies, the gradient of SiLU fused); elsewhere, or
where the CPU kernels cannot be built, a grouped ``conv1d``. The two agree to fp32 rounding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from k3.ops import cpu_kernels
from k3.ops.backend import use_c

__all__ = ["short_conv_silu"]


def short_conv_silu(x: torch.Tensor, w: torch.Tensor, prev: torch.Tensor | None = None) -> torch.Tensor:
    """x [B, T, C], w [C, K] (the taps, oldest first), prev [B, C, K−1] or None -> y [B, T, C]."""
    if x.dim() != 3:
        raise ValueError(f"short_conv_silu: x must be [B, T, C], got shape {tuple(x.shape)}")
    B, _, C = x.shape
    if w.dim() != 2 or w.shape[0] != C:
        raise ValueError(f"short_conv_silu: w must be [C={C}, K], got shape {tuple(w.shape)}")
    K = w.shape[1]
    if prev is not None and tuple(prev.shape) != (B, C, K - 1):
        raise ValueError(f"short_conv_silu: prev must be [B, C, K-1] = {(B, C, K - 1)}, got {tuple(prev.shape)}")
    if use_c("short_conv_silu", x.device.type == "cpu" and 1 <= K <= 16 and x.dtype == w.dtype == torch.float32
             and (prev is None or prev.dtype == torch.float32)):
        return _conv_op(x.contiguous(), w.t().contiguous(), None if prev is None else prev.contiguous())
    xt = x.transpose(1, 2)                                                 # [B, C, T]
    if prev is None:
        prev = xt.new_zeros(B, C, K - 1)
    xp = torch.cat([prev.to(xt.dtype), xt], -1)                            # [B, C, K−1+T]
    return F.silu(F.conv1d(xp, w.to(xp.dtype)[:, None, :], groups=C)).transpose(1, 2)


def _check_conv(op: str, x: torch.Tensor, w_t: torch.Tensor, prev: torch.Tensor | None) -> None:
    if x.dim() != 3 or w_t.dim() != 2:
        raise ValueError(f"{op}: x must be [B, T, C] and w_t [K, C], got {tuple(x.shape)} and {tuple(w_t.shape)}")
    B, _, C = x.shape
    K = w_t.shape[0]
    cpu_kernels.check_dense(op, x=(x, x.shape), w_t=(w_t, (K, C)),
                            **({} if prev is None else {"prev": (prev, (B, C, K - 1))}))


@torch.library.custom_op("k3::short_conv_silu", mutates_args=(), device_types="cpu")
def _conv_op(x: torch.Tensor, w_t: torch.Tensor, prev: torch.Tensor | None) -> torch.Tensor:
    """y [B, T, C] from x [B, T, C], taps w_t [K, C], prev [B, C, K−1] or None (all fp32, contiguous)."""
    _check_conv("k3::short_conv_silu", x, w_t, prev)
    B, T, C = x.shape
    y = torch.empty(B, T, C)
    rc = cpu_kernels.library().k3_short_conv_silu(B, T, C, w_t.shape[0], x.data_ptr(),
                                                  None if prev is None else prev.data_ptr(), w_t.data_ptr(),
                                                  y.data_ptr(), torch.get_num_threads())
    if rc:
        raise ValueError(f"short_conv_silu: conv width {w_t.shape[0]} outside 1..16")
    return y


@_conv_op.register_fake
def _(x, w_t, prev):
    return x.new_empty(x.shape)


@torch.library.custom_op("k3::short_conv_silu_backward", mutates_args=(), device_types="cpu")
def _conv_bwd_op(x: torch.Tensor, w_t: torch.Tensor, prev: torch.Tensor | None, dy: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx [B, T, C], dw_t [K, C], dprev [B, C, K−1], empty when prev is None)."""
    _check_conv("k3::short_conv_silu_backward", x, w_t, prev)
    B, T, C = x.shape
    K = w_t.shape[0]
    dy = dy.contiguous()
    cpu_kernels.check_dense("k3::short_conv_silu_backward", dy=(dy, (B, T, C)))
    dx, dw = torch.empty(B, T, C), torch.empty(K, C)
    dprev = torch.empty(B, C, K - 1) if prev is not None else torch.empty(0)
    rc = cpu_kernels.library().k3_short_conv_silu_bwd(
        B, T, C, K, x.data_ptr(), None if prev is None else prev.data_ptr(), w_t.data_ptr(),
        dy.data_ptr(), dx.data_ptr(), None if prev is None else dprev.data_ptr(), dw.data_ptr(),
        torch.get_num_threads())
    if rc:
        raise MemoryError(f"short_conv_silu: no memory for the backward of [{B}, {T}, {C}]")
    return dx, dw, dprev


@_conv_bwd_op.register_fake
def _(x, w_t, prev, dy):
    B, _, C = x.shape
    K = w_t.shape[0]
    return x.new_empty(x.shape), w_t.new_empty(w_t.shape), (x.new_empty(B, C, K - 1) if prev is not None
                                                            else x.new_empty(0))


def _conv_setup(ctx, inputs, output):
    x, w_t, prev = inputs
    ctx.has_prev = prev is not None
    ctx.save_for_backward(x, w_t, *([prev] if prev is not None else []))


def _conv_backward(ctx, dy):
    x, w_t, *prev = ctx.saved_tensors
    dx, dw, dprev = _conv_bwd_op(x, w_t, prev[0] if prev else None, dy.float())
    return dx, dw, (dprev if ctx.has_prev else None)


_conv_op.register_autograd(_conv_backward, setup_context=_conv_setup)
