"""The per-row pieces of the CPU decode step (``decode_rows.c``, built by ``k3.ops.cpu_kernels``):
the AttnRes mix of n sources, the KDA recurrent step after the input projections, the router and
the gated activation. ``k3.ops.decode_layers`` runs whole sublayers out of these same C functions;
the wrappers here call them one at a time (the step uses ``attn_res_mix_c`` and ``gated_act_c``
directly; the tests hold every piece to a float64 formula or an exact enumeration).
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import NamedTuple

import torch

from k3.ops import cpu_kernels
from k3.ops.backend import use_c
from k3.ops.packed_mm import check_rows

__all__ = ["attn_res_mix_c", "kda_step_c", "gated_act_c", "route_c", "map_c", "MAP_KINDS", "SortedRows",
           "sort_desc"]

MAP_KINDS = ("exp", "sigmoid", "tanh", "silu")


def map_c(kind: str, x: torch.Tensor) -> torch.Tensor:
    """A copy of ``x`` (fp32) with ``kind`` (one of ``MAP_KINDS``) applied by the kernels' own vector
    functions, which every kernel here uses (so the tests can hold them to float64)."""
    if kind not in MAP_KINDS:
        raise ValueError(f"map_c: kind must be one of {MAP_KINDS}, got {kind!r}")
    if x.dtype != torch.float32 or x.device.type != "cpu":
        raise ValueError(f"map_c: expected an fp32 CPU tensor, got {x.dtype} on {x.device.type}")
    y = x.contiguous().clone()
    cpu_kernels.library().k3_map(MAP_KINDS.index(kind), y.data_ptr(), y.numel())
    return y


def attn_res_mix_c(q: torch.Tensor, c: float, sources: Sequence[torch.Tensor]) -> torch.Tensor:
    """The AttnRes mix (``k3.ops.attn_res.attn_res_mix``) with its key norm folded into the query:
    n rows [B, H] -> [B, H] with q = √H γ ⊙ w [H] and c = H·eps; logit_i = <q, v_i> ·
    (Σv_i² + c)^(-1/2) = <w, γ ⊙ v_i / rms(v_i)>, α = softmax_i, out = Σ_i α_i v_i (one call, no
    stacked copy)."""
    n = len(sources)
    if n == 1:
        return sources[0]
    B, H = sources[0].shape
    for i, v in enumerate(sources):
        check_rows(v, H, f"attn_res_mix_c: source {i}", B)
    cpu_kernels.check_dense("attn_res_mix_c", q=(q, (H,)))
    out = torch.empty(B, H)
    ptrs = (ctypes.c_void_p * n)(*[v.data_ptr() for v in sources])
    lds = (ctypes.c_int64 * n)(*[v.stride(0) for v in sources])
    if cpu_kernels.library().k3_attn_res_mix(n, ptrs, lds, B, H, q.data_ptr(), c, out.data_ptr()):
        raise ValueError(f"attn_res_mix_c: {n} sources, at most 64")
    return out


def kda_step_c(qkv, conv, conv_w, dec_in, lb, neg_a, beta_in, gate, S, c_qk: float, q_scale: float, c_o: float):
    """One KDA recurrent step after the projections (the math of ``decode_rows.c``'s ``k3_kda_step``):
    qkv [B, 3P], conv [B, 3P, K−1], conv_w [3P, K], dec_in [B, P] (the decay's pre-activation),
    ``lb`` (exp(lb·σ(g)); None: exp(neg_a·softplus(g)), neg_a [P]), beta_in [B, nh], gate [B, P],
    S [B, nh, d, d] -> (o [B, P] normed and gated, conv' [B, 3P, K−1], S' [B, nh, d, d]).
    The outputs are ordinary tensors even under inference mode (the cache keeps them)."""
    B, nh, d, _ = S.shape
    P, K = nh * d, conv_w.shape[1]
    check_rows(qkv, 3 * P, "kda_step_c: qkv", B)
    check_rows(dec_in, P, "kda_step_c: dec_in", B)
    check_rows(beta_in, nh, "kda_step_c: beta_in", B)
    check_rows(gate, P, "kda_step_c: gate", B)
    cpu_kernels.check_dense("kda_step_c", conv=(conv, (B, 3 * P, K - 1)), conv_w=(conv_w, (3 * P, K)),
                            S=(S, (B, nh, d, d)))
    if lb is None:
        cpu_kernels.check_dense("kda_step_c", neg_a=(neg_a, (P,)))
    with torch.inference_mode(False):
        o, conv_out, S_out = torch.empty(B, P), torch.empty_like(conv), torch.empty_like(S)
    rc = cpu_kernels.library().k3_kda_step(
        B, nh, d, K, qkv.data_ptr(), qkv.stride(0), conv.data_ptr(), conv_out.data_ptr(), conv_w.data_ptr(),
        dec_in.data_ptr(), dec_in.stride(0), 0 if lb is not None else 1, 0.0 if lb is None else lb,
        None if lb is not None else neg_a.data_ptr(), beta_in.data_ptr(), beta_in.stride(0), gate.data_ptr(),
        gate.stride(0), S.data_ptr(), S_out.data_ptr(), c_qk, q_scale, c_o, o.data_ptr(), torch.get_num_threads())
    if rc:
        raise ValueError(f"kda_step_c: head_dim {d} above 256 or conv kernel {K} below 2")
    return o, conv_out, S_out


def gated_act_c(g: torch.Tensor, u: torch.Tensor, silu: bool, inv_beta: float, tanh_up: bool,
                row_w: torch.Tensor | None = None) -> torch.Tensor:
    """[R, F] rows g, u -> act(g, u) (· row_w[r] per row when given): SiLU(g)·u, or SiTU's
    tanh(g·inv_beta)·σ(g)·(tanh(u) if tanh_up else u)."""
    R, F = g.shape
    check_rows(g, F, "gated_act_c: g", R)
    check_rows(u, F, "gated_act_c: u", R)
    if row_w is not None:
        row_w = row_w.reshape(-1)
        cpu_kernels.check_dense("gated_act_c", row_w=(row_w, (R,)))
    out = torch.empty(R, F)
    cpu_kernels.library().k3_gated_act(R, F, g.data_ptr(), g.stride(0), u.data_ptr(), u.stride(0), int(silu),
                                       inv_beta, int(tanh_up), None if row_w is None else row_w.data_ptr(),
                                       out.data_ptr(), torch.get_num_threads())
    return out


def route_c(logits: torch.Tensor, bias: torch.Tensor, k: int, softmax: bool, renorm: bool,
            tiny: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The router of N tokens: logits [N, E], bias [E] -> (idx [N, k] int64, w [N, k]): the k experts of
    largest score + bias (score σ(logit), or the softmax over E), descending, ties to the lower index;
    w their scores (over their sum + tiny when ``renorm``)."""
    N, E = logits.shape
    check_rows(logits, E, "route_c: logits", N)
    cpu_kernels.check_dense("route_c", bias=(bias, (E,)))
    idx, w = torch.empty(N, k, dtype=torch.int64), torch.empty(N, k)
    if cpu_kernels.library().k3_route(N, E, logits.data_ptr(), logits.stride(0), bias.data_ptr(), k, int(softmax),
                                      int(renorm), tiny, idx.data_ptr(), w.data_ptr()):
        raise ValueError(f"route_c: top-k {k} must be in [1, {E}] and E at most 4096")
    return idx, w


class SortedRows(NamedTuple):
    values: torch.Tensor
    indices: torch.Tensor


def sort_desc(z: torch.Tensor) -> SortedRows:
    """``z.sort(dim=-1, descending=True, stable=True)`` of a 2-D tensor, bitwise the same result:
    fp32 CPU rows by the C radix sort (``k3_sort_desc``, O(V) per row: a batch of vocabulary rows
    for top-k / top-p sampling), anything else by torch."""
    if not use_c("sort_desc", z.dim() == 2 and z.dtype == torch.float32 and z.device.type == "cpu"):
        s = z.sort(dim=-1, descending=True, stable=True)
        return SortedRows(s.values, s.indices)
    z = z.contiguous()
    R, V = z.shape
    vals, idx = torch.empty(R, V), torch.empty(R, V, dtype=torch.int64)
    if cpu_kernels.library().k3_sort_desc(z.data_ptr(), R, V, vals.data_ptr(), idx.data_ptr(),
                                          torch.get_num_threads()):
        raise MemoryError(f"sort_desc: no memory to sort rows of {V}")
    return SortedRows(vals, idx)
