"""The two normalizations every layer shares (SPEC §3): RMSNorm and the per-head L2 norm.

    rms_norm(x; w, eps)  = w · x / sqrt(mean_D(x²) + eps)      (RMSNorm, learned weight w [D])
    l2_normalize(x; eps) = x / sqrt(Σ_D x² + eps)              (KDA's q, k per head, eps = 1e-6)

Both reduce over the last dim D, compute in fp32 and return x's dtype. Every RMSNorm in the model
(``k3.model.norm.RMSNorm``, the AttnRes key norm in :mod:`k3.ops.attn_res`, KDA's output norm)
calls ``rms_norm``; KDA's q/k normalization calls ``l2_normalize``. On the CPU with fp32 x and
weight, ``rms_norm`` is one C call forward (keeping 1/rms per row) and one backward (``k3::rms_norm``,
``rms_norm.c``: dx and the weight's gradient fused, the latter summed over fixed blocks of rows);
elsewhere, or where the CPU kernels cannot be built, the torch formulation below. The two agree to
fp32 rounding.
"""

from __future__ import annotations

import torch

from k3.ops import cpu_kernels
from k3.ops.backend import use_c

__all__ = ["rms_norm", "rms_norm_inference", "l2_normalize", "inv_rms"]


def inv_rms(x: torch.Tensor, eps: float, keepdim: bool = False) -> torch.Tensor:
    """x [..., D] fp32 -> 1 / sqrt(mean_D(x²) + eps), [...] (or [..., 1] with keepdim); written in
    place on its own fresh intermediate (the inference paths' form)."""
    return x.pow(2).mean(-1, keepdim=keepdim).add_(eps).rsqrt_()


def rms_norm_inference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``rms_norm``'s torch form for fp32 without autograd: the same operations, in place on fresh
    intermediates (bit-identical to the general form, fewer allocations)."""
    return torch.mul(x, inv_rms(x, eps, keepdim=True)).mul_(weight)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., D], weight [D] -> weight · x / sqrt(mean(x²) + eps) in x's dtype (fp32 compute)."""
    if use_c("rms_norm", x.device.type == "cpu" and x.dtype == weight.dtype == torch.float32 and x.numel() > 0
             and weight.shape == x.shape[-1:]):
        return _norm_op(x.contiguous().view(-1, x.shape[-1]), weight.contiguous(), float(eps))[0].view(x.shape)
    if x.dtype == weight.dtype == torch.float32 and not torch.is_grad_enabled():
        return rms_norm_inference(x, weight, eps)
    x32 = x.float()
    y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.float() * y).to(x.dtype)


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x [..., D] -> x / sqrt(Σ x² + eps) over the last dim in x's dtype (fp32 compute)."""
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).sum(-1, keepdim=True) + eps)).to(x.dtype)


def _check_norm(op: str, x: torch.Tensor, weight: torch.Tensor, **more) -> None:
    if x.dim() != 2:
        raise ValueError(f"{op}: x must be [M, D], got shape {tuple(x.shape)}")
    M, D = x.shape
    cpu_kernels.check_dense(op, x=(x, (M, D)), weight=(weight, (D,)),
                            **{k: (t, (M,) if k == "rinv" else (M, D)) for k, t in more.items()})


@torch.library.custom_op("k3::rms_norm", mutates_args=(), device_types="cpu")
def _norm_op(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(y [M, D], 1/rms [M]) of fp32 x [M, D] and weight [D] (contiguous)."""
    _check_norm("k3::rms_norm", x, weight)
    M, D = x.shape
    y, rinv = torch.empty(M, D), torch.empty(M)
    cpu_kernels.library().k3_rms_norm(M, D, x.data_ptr(), weight.data_ptr(), eps, y.data_ptr(), rinv.data_ptr(),
                                      torch.get_num_threads())
    return y, rinv


@_norm_op.register_fake
def _(x, weight, eps):
    return x.new_empty(x.shape), x.new_empty(x.shape[:1])


@torch.library.custom_op("k3::rms_norm_backward", mutates_args=(), device_types="cpu")
def _norm_bwd_op(x: torch.Tensor, weight: torch.Tensor, rinv: torch.Tensor, dy: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx [M, D], dweight [D]) for the output gradient dy."""
    _check_norm("k3::rms_norm_backward", x, weight, rinv=rinv, dy=dy)
    M, D = x.shape
    dx, dw = torch.empty(M, D), torch.empty(D)
    rc = cpu_kernels.library().k3_rms_norm_bwd(M, D, x.data_ptr(), weight.data_ptr(), rinv.data_ptr(),
                                               dy.data_ptr(), dx.data_ptr(), dw.data_ptr(), torch.get_num_threads())
    if rc:
        raise MemoryError(f"rms_norm: no memory for the backward of [{M}, {D}]")
    return dx, dw


@_norm_bwd_op.register_fake
def _(x, weight, rinv, dy):
    return x.new_empty(x.shape), weight.new_empty(weight.shape)


def _norm_setup(ctx, inputs, output):
    x, weight, _ = inputs
    ctx.save_for_backward(x, weight, output[1])
    ctx.mark_non_differentiable(output[1])


def _norm_backward(ctx, dy, _drinv):
    x, weight, rinv = ctx.saved_tensors
    dx, dw = _norm_bwd_op(x, weight, rinv, dy.float().contiguous())
    return dx, dw, None


_norm_op.register_autograd(_norm_backward, setup_context=_norm_setup)
