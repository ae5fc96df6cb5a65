"""Whole decode sublayers in one C call (``decode_layers.c``): the KDA attention and the LatentMoE of
a layer over packed weights, described once by a ctypes struct (``KDALayer``, ``MoELayer``) that
``k3.infer.prepared`` fills at preparation. The struct holds raw pointers: its owner keeps the
tensors alive and rebuilds it when they change (``WeightWatch``).

The ctypes structs are in ``k3.ops.kernel_structs`` (checked against the C ones in ``k3_kernels.h``
when the kernels load)."""

from __future__ import annotations

import ctypes

import torch

from k3.ops import cpu_kernels
from k3.ops.kernel_structs import KDALayer, Mat, MLALayer, MoELayer
from k3.ops.packed_mm import PackedMatrix

__all__ = ["KDALayer", "MLALayer", "MoELayer", "mat", "ptr", "kda_layer_step", "mla_layer_step", "moe_layer_step"]

def mat(p: PackedMatrix | None) -> Mat:
    """The C view of a packed matrix (all zero for None: the part is absent)."""
    return Mat() if p is None else Mat(p.data.data_ptr(), p.K, p.N, p.E)


def ptr(t: torch.Tensor | None) -> int | None:
    if t is None:
        return None
    if t.dtype != torch.float32 or not t.is_contiguous() or t.device.type != "cpu":
        raise ValueError(f"decode_layers: a layer tensor must be contiguous fp32 on the CPU, got {t.dtype} "
                         f"{tuple(t.shape)} contiguous={t.is_contiguous()}")
    return t.data_ptr()


def _rows(x: torch.Tensor, B: int, H: int, what: str) -> None:
    if x.dtype != torch.float32 or tuple(x.shape) != (B, H) or not x.is_contiguous() or x.device.type != "cpu":
        raise ValueError(f"{what}: expected contiguous fp32 CPU rows [{B}, {H}], got {x.dtype} {tuple(x.shape)} "
                         f"contiguous={x.is_contiguous()}")


def kda_layer_step(L: KDALayer, x: torch.Tensor, res: torch.Tensor | None, conv: torch.Tensor, S: torch.Tensor,
                   in_place: bool = False):
    """x [B, H] (pre-norm), res [B, H] | None, conv [B, 3P, K−1], S [B, nh, d, d] ->
    (res + KDA(n(x)) [B, H], conv', S'); conv' and S' are ordinary tensors even under inference mode.
    ``in_place``: S' is written over S (returned as S') when S is contiguous fp32 and not an inference
    tensor: the step then writes the state once instead of reading a fresh buffer in to write it (each
    element of S is read before it is overwritten, so the values are the same)."""
    B, H = x.shape
    P = L.nh * L.d
    _rows(x, B, L.w_in.K, "kda_layer_step: x")
    if res is not None:
        _rows(res, B, H, "kda_layer_step: res")
    if tuple(conv.shape) != (B, 3 * P, L.Kc - 1) or tuple(S.shape) != (B, L.nh, L.d, L.d):
        raise ValueError(f"kda_layer_step: conv {tuple(conv.shape)} / S {tuple(S.shape)} do not fit "
                         f"{B} rows of {L.nh} heads of {L.d}")
    conv, S = conv.float().contiguous(), S.float().contiguous()
    out = torch.empty(B, L.w_o.N)
    with torch.inference_mode(False):
        conv_out = torch.empty_like(conv)
        S_out = S if in_place and not S.is_inference() else torch.empty_like(S)
    rc = cpu_kernels.library().k3_kda_layer_step(
        ctypes.byref(L), B, x.data_ptr(), None if res is None else res.data_ptr(), conv.data_ptr(), S.data_ptr(),
        out.data_ptr(), conv_out.data_ptr(), S_out.data_ptr(), torch.get_num_threads())
    if rc:
        raise RuntimeError(f"kda_layer_step: the kernel failed ({rc})")
    return out, conv_out, S_out


def _latents(t: torch.Tensor, B: int, width: int, what: str) -> int:
    """t [B, S, width] with unit strides inside a row: returns its batch stride."""
    if t.dtype != torch.float32 or t.dim() != 3 or t.shape[0] != B or t.shape[2] != width or \
            (t.shape[1] > 1 and t.stride(1) != width) or t.stride(2) != 1 or t.device.type != "cpu":
        raise ValueError(f"mla_layer_step: {what} must be fp32 [{B}, S, {width}] with contiguous rows, got "
                         f"{t.dtype} {tuple(t.shape)} strides {t.stride()}")
    return t.stride(0)


def mla_layer_step(L: MLALayer, x: torch.Tensor, res: torch.Tensor | None, c_buf: torch.Tensor,
                   pe_buf: torch.Tensor, lengths: torch.Tensor):
    """x [B, H] (pre-norm), res [B, H] | None, c_buf [B, S, r], pe_buf [B, S, p] (row b's first
    lengths[b] entries valid) -> (res + MLA(n(x)) [B, H], c_new [B, r], pe_new [B, p])."""
    B, H = x.shape
    _rows(x, B, L.w_in.K, "mla_layer_step: x")
    if res is not None:
        _rows(res, B, H, "mla_layer_step: res")
    ldc, ldp = _latents(c_buf, B, L.r, "c_buf"), _latents(pe_buf, B, L.p, "pe_buf")
    if c_buf.shape[1] != pe_buf.shape[1]:
        raise ValueError(f"mla_layer_step: c_buf holds {c_buf.shape[1]} tokens, pe_buf {pe_buf.shape[1]}")
    lengths = lengths.to(torch.int64).contiguous()
    if tuple(lengths.shape) != (B,):
        raise ValueError(f"mla_layer_step: lengths must be [{B}], got {tuple(lengths.shape)}")
    out = torch.empty(B, L.w_o.N)
    c_new, pe_new = torch.empty(B, L.r), torch.empty(B, L.p)
    rc = cpu_kernels.library().k3_mla_layer_step(
        ctypes.byref(L), B, x.data_ptr(), None if res is None else res.data_ptr(), c_buf.data_ptr(), ldc,
        pe_buf.data_ptr(), ldp, c_buf.shape[1], lengths.data_ptr(), out.data_ptr(), c_new.data_ptr(),
        pe_new.data_ptr(), torch.get_num_threads())
    if rc:
        raise RuntimeError(f"mla_layer_step: the kernel failed ({rc})")
    return out, c_new, pe_new


def moe_layer_step(L: MoELayer, x: torch.Tensor, res: torch.Tensor | None) -> torch.Tensor:
    """x [N, H] (pre-norm), res [N, H] | None -> res + LatentMoE(n(x))."""
    N, H = x.shape
    _rows(x, N, L.w_in.K, "moe_layer_step: x")
    if res is not None:
        _rows(res, N, H, "moe_layer_step: res")
    out = torch.empty(N, H)
    rc = cpu_kernels.library().k3_moe_layer_step(ctypes.byref(L), N, x.data_ptr(),
                                                   None if res is None else res.data_ptr(), out.data_ptr(),
                                                   torch.get_num_threads())
    if rc:
        raise RuntimeError(f"moe_layer_step: the kernel failed ({rc})")
    return out
