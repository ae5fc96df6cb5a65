"""Next-token cross-entropy over the vocabulary: ``cross_entropy(logits [N, V], target [N])``.

    loss_i = logsumexp_j z_ij − z_i,y_i,   0 where y_i = ignore_index;  mean over the kept rows

On the CPU with fp32 logits it is one C call forward and one backward (``k3::cross_entropy``,
``cross_entropy.c``): the forward keeps only each row's logsumexp, and the backward writes
softmax − one-hot straight into the gradient, instead of ATen's log-softmax, its saved [N, V]
output, the one-hot fill and their backward. Elsewhere, or where the CPU kernels cannot be built,
``F.cross_entropy``. The two agree to fp32 rounding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from k3.ops import cpu_kernels
from k3.ops.backend import use_c

__all__ = ["cross_entropy"]

REDUCTIONS = ("mean", "sum", "none")


def cross_entropy(logits: torch.Tensor, target: torch.Tensor, ignore_index: int = -100,
                  reduction: str = "mean") -> torch.Tensor:
    """logits [N, V] (computed in fp32), target [N] int64 -> the loss (``reduction`` as torch's)."""
    if reduction not in REDUCTIONS:
        raise ValueError(f"cross_entropy: reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if logits.dim() != 2 or target.shape != logits.shape[:1]:
        raise ValueError(f"cross_entropy: logits must be [N, V] and target [N], got {tuple(logits.shape)} "
                         f"and {tuple(target.shape)}")
    logits = logits.float()
    if not use_c("cross_entropy", logits.device.type == "cpu" and target.dtype == torch.int64):
        return F.cross_entropy(logits, target, ignore_index=ignore_index, reduction=reduction)
    rows, _ = _ce_op(logits.contiguous(), target.contiguous(), ignore_index)
    if reduction == "none":
        return rows
    total = rows.sum()
    return total if reduction == "sum" else total / (target != ignore_index).sum()


def _check_ce(op: str, logits: torch.Tensor, target: torch.Tensor, **rows) -> None:
    if logits.dim() != 2:
        raise ValueError(f"{op}: logits must be [N, V], got shape {tuple(logits.shape)}")
    N = logits.shape[0]
    cpu_kernels.check_dense(op, logits=(logits, logits.shape), **{k: (t, (N,)) for k, t in rows.items()})
    if target.dtype != torch.int64 or target.device.type != "cpu" or target.shape != (N,) \
            or not target.is_contiguous():
        raise ValueError(f"{op}: target: expected a contiguous int64 CPU tensor [{N}], got {target.dtype} "
                         f"{target.device.type} {tuple(target.shape)}")


def _refuse_target(rc: int, target: torch.Tensor, ignore_index: int, V: int) -> None:
    if rc:
        bad = ((target != ignore_index) & ((target < 0) | (target >= V))).nonzero()[0, 0]
        raise IndexError(f"cross_entropy: target {int(target[bad])} at row {int(bad)} is outside the vocabulary "
                         f"[0, {V})")


@torch.library.custom_op("k3::cross_entropy", mutates_args=(), device_types="cpu")
def _ce_op(logits: torch.Tensor, target: torch.Tensor, ignore_index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss [N], logsumexp [N]) of fp32 logits [N, V] against int64 targets [N]."""
    _check_ce("k3::cross_entropy", logits, target)
    N, V = logits.shape
    loss, lse = torch.empty(N), torch.empty(N)
    rc = cpu_kernels.library().k3_cross_entropy(N, V, logits.data_ptr(), target.data_ptr(), ignore_index,
                                                loss.data_ptr(), lse.data_ptr(), torch.get_num_threads())
    _refuse_target(rc, target, ignore_index, V)
    return loss, lse


@_ce_op.register_fake
def _(logits, target, ignore_index):
    return logits.new_empty(logits.shape[:1]), logits.new_empty(logits.shape[:1])


@torch.library.custom_op("k3::cross_entropy_backward", mutates_args=(), device_types="cpu")
def _ce_bwd_op(logits: torch.Tensor, target: torch.Tensor, lse: torch.Tensor, dloss: torch.Tensor,
               ignore_index: int) -> torch.Tensor:
    """dlogits [N, V] = dloss_i (softmax(logits_i) − onehot(target_i)), 0 on ignored rows."""
    _check_ce("k3::cross_entropy_backward", logits, target, lse=lse, dloss=dloss)
    N, V = logits.shape
    d = torch.empty(N, V)
    rc = cpu_kernels.library().k3_cross_entropy_bwd(N, V, logits.data_ptr(), target.data_ptr(), ignore_index,
                                                    lse.data_ptr(), dloss.data_ptr(), d.data_ptr(),
                                                    torch.get_num_threads())
    _refuse_target(rc, target, ignore_index, V)
    return d


@_ce_bwd_op.register_fake
def _(logits, target, lse, dloss, ignore_index):
    return logits.new_empty(logits.shape)


def _ce_setup(ctx, inputs, output):
    logits, target, ctx.ignore_index = inputs
    ctx.save_for_backward(logits, target, output[1])
    ctx.mark_non_differentiable(output[1])


def _ce_backward(ctx, dloss, _dlse):
    logits, target, lse = ctx.saved_tensors
    return _ce_bwd_op(logits, target, lse, dloss.float().contiguous(), ctx.ignore_index), None, None


_ce_op.register_autograd(_ce_backward, setup_context=_ce_setup)
