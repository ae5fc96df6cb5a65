"""Attention Residuals mixing (SPEC §3.3).

Given sources v_0..v_{n-1} (each [..., H]), a pseudo-query w [H] and a key-norm weight γ [H]:

    key_i   = RMSNorm(v_i; γ)          (fp32)
    logit_i = <w, key_i>               (no 1/sqrt(d))
    α       = softmax_i(logit)
    out     = Σ_i α_i v_i              (raw sources, fp32 accumulate, cast to v's dtype)

A single source is returned unchanged (softmax over one logit is exactly 1). Zero w gives the
uniform mean of the sources.
"""

from __future__ import annotations

import ctypes
from typing import Sequence

import torch

from k3.ops import cpu_kernels
from k3.ops.backend import use_c
from k3.ops.norm import rms_norm

__all__ = ["attn_res_mix", "compiled_attn_res_mix"]


def attn_res_mix(sources: Sequence[torch.Tensor], query: torch.Tensor, norm_weight: torch.Tensor,
                 eps: float = 1e-5) -> torch.Tensor:
    """sources: n tensors [..., H]; query, norm_weight: [H] (query may be [1, H]) -> [..., H].

    fp32 sources on the CPU go through one C call forward and one backward (``k3::attn_res_mix``,
    ``attn_res.c``: the key norm's weight folded into the query, no stacked copy of the sources);
    anything else, or where the CPU kernels cannot be built, through the torch formulation of the
    module docstring. The two agree to fp32 rounding (tested against float64)."""
    if len(sources) == 0:
        raise ValueError("attn_res_mix needs at least one source")
    if len(sources) == 1:
        return sources[0]
    if use_c("attn_res_mix", _c_fits(sources, query, norm_weight)):
        H = norm_weight.shape[-1]
        q = (norm_weight * query.reshape(-1)) * H ** 0.5
        return _mix_op(list(sources), q, float(H * eps))[0]
    return _mix_torch(sources, query, norm_weight, eps)


def _mix_torch(sources: Sequence[torch.Tensor], query: torch.Tensor, norm_weight: torch.Tensor,
               eps: float) -> torch.Tensor:
    dtype = sources[0].dtype
    with torch.autocast(sources[0].device.type, enabled=False):   # fp32 even under bf16 autocast
        v = torch.stack(sources, dim=0).float()                   # [n, ..., H]
        key = rms_norm(v, norm_weight, eps)                       # fp32 (v is fp32)
        logits = key @ query.reshape(-1).float()                  # [n, ...]
        alpha = torch.softmax(logits, dim=0).unsqueeze(-1)        # [n, ..., 1]
        return (alpha * v).sum(0).to(dtype)


def _c_fits(sources, query, norm_weight) -> bool:
    first = sources[0]
    H = first.shape[-1] if first.dim() else 0
    return (first.device.type == "cpu" and len(sources) <= 64 and H > 0
            and all(x.dtype == torch.float32 and x.device.type == "cpu" for x in (*sources, query, norm_weight))
            and all(x.shape == first.shape for x in sources)
            and query.numel() == norm_weight.numel() == H)


def _checked_mix(op: str, sources: list[torch.Tensor], q: torch.Tensor):
    """(contiguous sources, contiguous q) once they are 1 to 64 fp32 tensors of one shape [..., H]
    and q is [H]; else a ValueError naming the argument."""
    if not 1 <= len(sources) <= 64:
        raise ValueError(f"{op}: 1 to 64 sources, got {len(sources)}")
    srcs, q = [x.contiguous() for x in sources], q.contiguous()
    shape = srcs[0].shape
    cpu_kernels.check_dense(op, q=(q, shape[-1:]), **{f"sources[{i}]": (x, shape) for i, x in enumerate(srcs)})
    return srcs, q


def _pointers(ts: Sequence[torch.Tensor]):
    return (ctypes.c_void_p * len(ts))(*[t.data_ptr() for t in ts]), (ctypes.c_int64 * len(ts))(
        *[t.shape[-1] for t in ts])


@torch.library.custom_op("k3::attn_res_mix", mutates_args=(), device_types="cpu")
def _mix_op(sources: list[torch.Tensor], q: torch.Tensor, c: float
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out [..., H], alpha, r, p [M, n]): the mix of n fp32 sources [..., H] with the folded query
    q [H] and c = H·eps (``attn_res.c``); alpha, r, p are kept for the backward."""
    srcs, q = _checked_mix("k3::attn_res_mix", sources, q)
    n, H = len(srcs), srcs[0].shape[-1]
    M = srcs[0].numel() // max(H, 1)
    out, alpha, r, p = torch.empty(srcs[0].shape), torch.empty(M, n), torch.empty(M, n), torch.empty(M, n)
    ptrs, lds = _pointers(srcs)
    cpu_kernels.library().k3_attn_res_fwd(n, ptrs, lds, M, H, q.data_ptr(), c, out.data_ptr(),
                                          alpha.data_ptr(), r.data_ptr(), p.data_ptr(), torch.get_num_threads())
    return out, alpha, r, p


@_mix_op.register_fake
def _(sources, q, c):
    n, first = len(sources), sources[0]
    M = first.numel() // max(first.shape[-1], 1)
    return first.new_empty(first.shape), *(first.new_empty(M, n) for _ in range(3))


@torch.library.custom_op("k3::attn_res_mix_backward", mutates_args=(), device_types="cpu")
def _mix_bwd_op(sources: list[torch.Tensor], q: torch.Tensor, alpha: torch.Tensor, r: torch.Tensor,
                p: torch.Tensor, dout: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(d sources stacked [n, ..., H], dq [H])."""
    srcs, q = _checked_mix("k3::attn_res_mix_backward", sources, q)
    n, H = len(srcs), srcs[0].shape[-1]
    M = srcs[0].numel() // max(H, 1)
    dout = dout.contiguous()
    cpu_kernels.check_dense("k3::attn_res_mix_backward", alpha=(alpha, (M, n)), r=(r, (M, n)), p=(p, (M, n)),
                            dout=(dout, srcs[0].shape))
    dsrc, dq = torch.empty(n, *srcs[0].shape), torch.empty(H)
    ptrs, lds = _pointers(srcs)
    douts = (ctypes.c_void_p * n)(*[dsrc.data_ptr() + i * M * H * 4 for i in range(n)])
    rc = cpu_kernels.library().k3_attn_res_bwd(
        n, ptrs, lds, M, H, q.data_ptr(), alpha.data_ptr(), r.data_ptr(), p.data_ptr(), dout.data_ptr(), douts,
        dq.data_ptr(), torch.get_num_threads())
    if rc:
        raise MemoryError(f"attn_res_mix: no memory for the backward's sums over {M} rows of {H}")
    return dsrc, dq


@_mix_bwd_op.register_fake
def _(sources, q, alpha, r, p, dout):
    first = sources[0]
    return first.new_empty(len(sources), *first.shape), q.new_empty(first.shape[-1])


def _mix_setup(ctx, inputs, output):
    sources, q, _ = inputs
    _, alpha, r, p = output
    ctx.save_for_backward(q, alpha, r, p, *sources)


def _mix_backward(ctx, dout, _da, _dr, _dp):
    q, alpha, r, p, *sources = ctx.saved_tensors
    dsrc, dq = _mix_bwd_op(sources, q, alpha, r, p, dout.float())
    return list(dsrc.unbind(0)), dq, None


_mix_op.register_autograd(_mix_backward, setup_context=_mix_setup)


_COMPILED = None


def compiled_attn_res_mix(sources: Sequence[torch.Tensor], query: torch.Tensor, norm_weight: torch.Tensor,
                          eps: float = 1e-5) -> torch.Tensor:
    """``attn_res_mix`` through ``torch.compile`` (opt-in, never the default): inductor fuses the key
    norm, logits, softmax and weighted sum, forward and backward, into a few loops over the stacked
    sources (measured 6.4–7.5× on ``tiny``'s training shape, 1 thread, after 6–16 s of compile per
    distinct number of sources). Same math; fp32 rounding differs from eager (re-associated sums),
    so runs that must match the golden losses stay eager."""
    global _COMPILED
    if _COMPILED is None:
        _COMPILED = torch.compile(_mix_torch, dynamic=False)
    if len(sources) == 1:
        return sources[0]
    return _COMPILED(sources, query, norm_weight, eps)
