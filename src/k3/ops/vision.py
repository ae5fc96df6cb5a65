"""The vision tower's math (SPEC §3.9), tensor in, tensor out; the modules are :mod:`k3.model.vision`.

Images are packed NaViT-style: ``grid_thws`` [n, 3] holds each item's (t, h, w) in patches and the
N = Σ t·h·w patches follow one another, each item frame-major then row-major (patch index
t·h·w-offset + τ·h·w + y·w + x). Items never see each other: attention runs within each
``cu_seqlens`` segment.

    patch_positions   grid -> [N, 2] (row y, column x) of every patch
    rope_2d           x [N, heads, d] rotated by 2-D RoPE: pair (4i, 4i+1) by x·f_i,
                      pair (4i+2, 4i+3) by y·f_i, f_i = θ^(−4i/d), interleaved, fp32
    resize_pos_table  [H0, W0, D] learned table -> [h, w, D] (F.interpolate, align_corners False)
    time_embedding    [t, D] fixed sin/cos: concat(sin(τω), cos(τω)), ω_k = 10000^(−k/(D/2))
    pos_embedding     the per-patch position term [N, D] of a packed batch
    varlen_attention  non-causal softmax(q·kᵀ/√d)·v within each segment
    merge_patches     [N, D] -> [M, kh·kw, D]: kh×kw neighbours, members row-major, mean over t
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

__all__ = ["grid_list", "cu_seqlens", "patch_positions", "rope_2d", "resize_pos_table", "time_embedding",
           "pos_embedding", "varlen_attention", "merge_patches"]


def grid_list(grid_thws: torch.Tensor | list) -> list[tuple[int, int, int]]:
    """``grid_thws`` [n, 3] (tensor or nested list) -> [(t, h, w), ...], each entry a positive int."""
    rows = grid_thws.tolist() if isinstance(grid_thws, torch.Tensor) else list(grid_thws)
    out = []
    for r in rows:
        if len(r) != 3 or any(isinstance(v, bool) or int(v) != v or v < 1 for v in r):
            raise ValueError(f"grid_thws rows must be three positive ints (t, h, w), got {r!r}")
        out.append((int(r[0]), int(r[1]), int(r[2])))
    return out


def cu_seqlens(grid_thws, device: torch.device | str | None = None) -> torch.Tensor:
    """[n + 1] int32 segment starts: 0, then the running sum of t·h·w."""
    lens = [t * h * w for t, h, w in grid_list(grid_thws)]
    return torch.tensor([0] + lens, dtype=torch.int32, device=device).cumsum(0, dtype=torch.int32)


def patch_positions(grid_thws, device: torch.device | str | None = None) -> torch.Tensor:
    """[N, 2] int64 (row y, column x) of each patch, items in order, frame-major then row-major."""
    parts = []
    for t, h, w in grid_list(grid_thws):
        y, x = torch.meshgrid(torch.arange(h, device=device), torch.arange(w, device=device), indexing="ij")
        parts.append(torch.stack((y.reshape(-1), x.reshape(-1)), -1).repeat(t, 1))
    return torch.cat(parts) if parts else torch.zeros(0, 2, dtype=torch.long, device=device)


def rope_2d(x: torch.Tensor, pos: torch.Tensor, theta: float = 10000.0) -> torch.Tensor:
    """x [N, heads, d] (d % 4 == 0), pos [N, 2] (y, x) -> x rotated, in x's dtype (fp32 math).

    Complex slot k = channels (2k, 2k+1); slot 2i turns by x·f_i, slot 2i+1 by y·f_i, with
    (a, b) -> (a cos φ − b sin φ, a sin φ + b cos φ).
    """
    N, _, d = x.shape
    if d % 4 or pos.shape != (N, 2):
        raise ValueError(f"rope_2d: x [N, heads, d] with d % 4 == 0 and pos [N, 2], got {tuple(x.shape)} "
                         f"and {tuple(pos.shape)}")
    f = theta ** (-torch.arange(0, d, 4, device=x.device, dtype=torch.float32) / d)           # [d/4]
    p = pos.to(torch.float32)
    angle = torch.stack((p[:, 1:2] * f, p[:, 0:1] * f), -1).reshape(N, 1, d // 2)              # [N, 1, d/2]
    cos, sin = angle.cos(), angle.sin()
    a, b = x.float().unflatten(-1, (d // 2, 2)).unbind(-1)
    return torch.stack((a * cos - b * sin, a * sin + b * cos), -1).flatten(-2).to(x.dtype)


def resize_pos_table(table: torch.Tensor, h: int, w: int, mode: str = "bilinear") -> torch.Tensor:
    """table [H0, W0, D] -> [h, w, D]: the table itself at its own size, else ``F.interpolate``
    (``mode`` bilinear or bicubic, align_corners False, no antialias)."""
    if (h, w) == tuple(table.shape[:2]):
        return table
    grid = F.interpolate(table.permute(2, 0, 1)[None], size=(h, w), mode=mode, align_corners=False)
    return grid[0].permute(1, 2, 0)


def time_embedding(t: int, dim: int, device: torch.device | str | None = None) -> torch.Tensor:
    """[t, dim] fp32: row τ = concat(sin(τ·ω), cos(τ·ω)), ω_k = 10000^(−k/(dim/2)), k < dim/2."""
    if dim % 2:
        raise ValueError(f"time_embedding: dim must be even, got {dim}")
    omega = 1.0 / 10000 ** (torch.arange(dim // 2, dtype=torch.float64, device=device) / (dim / 2))
    ang = torch.arange(t, dtype=torch.float64, device=device)[:, None] * omega
    return torch.cat((ang.sin(), ang.cos()), -1).float()


def pos_embedding(table: torch.Tensor, grid_thws, mode: str = "bilinear", max_t: int = 4) -> torch.Tensor:
    """The position term [N, D] of a packed batch, in ``table``'s dtype: the table resized to each
    item's (h, w); for t > 1 (t ≤ ``max_t``) frame τ adds ``time_embedding``[τ] (none when t = 1)."""
    D = table.shape[-1]
    parts = []
    for t, h, w in grid_list(grid_thws):
        e = resize_pos_table(table, h, w, mode).reshape(h * w, D)
        if t > 1:
            if t > max_t:
                raise ValueError(f"pos_embedding: an item has t={t} frames, more than the {max_t} the "
                                 "time embedding covers")
            e = (e[None].float() + time_embedding(t, D, table.device)[:, None]).reshape(t * h * w, D)
        parts.append(e.to(table.dtype))
    return torch.cat(parts) if parts else table.new_zeros(0, D)


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor,
                     scale: float | None = None) -> torch.Tensor:
    """q, k, v [N, heads, d], cu [n + 1] segment starts -> [N, heads, d]: non-causal attention
    within each segment [cu[i], cu[i+1]), never across (softmax scale ``scale`` or 1/√d)."""
    if not (q.shape == k.shape == v.shape and q.dim() == 3):
        raise ValueError(f"varlen_attention: q, k, v must be one shape [N, heads, d], got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    bounds = cu.tolist()
    if bounds[0] != 0 or bounds[-1] != q.shape[0] or any(b < a for a, b in zip(bounds, bounds[1:])):
        raise ValueError(f"varlen_attention: cu_seqlens must rise from 0 to N={q.shape[0]}, got {bounds}")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    out = []
    for a, b in zip(bounds, bounds[1:]):
        qs, ks, vs = (z[a:b].transpose(0, 1)[None] for z in (q, k, v))                          # [1, H, n, d]
        out.append(F.scaled_dot_product_attention(qs, ks, vs, scale=scale)[0].transpose(0, 1))
    return torch.cat(out) if out else torch.empty_like(q)


def merge_patches(x: torch.Tensor, grid_thws, kernel: tuple[int, int] | list[int] = (2, 2)) -> torch.Tensor:
    """x [N, D] -> [M, kh·kw, D], M = Σ (h/kh)(w/kw): merged token (R, C) of each item (row-major)
    holds patches (kh·R + a, kw·C + b) in order (a, b) = (0,0), (0,1), ..., averaged over t frames."""
    kh, kw = kernel
    D = x.shape[-1]
    out, start = [], 0
    for t, h, w in grid_list(grid_thws):
        if h % kh or w % kw:
            raise ValueError(f"merge_patches: grid {h}x{w} is not a multiple of the merge kernel {kh}x{kw}")
        seq = x[start:start + t * h * w].view(t, h // kh, kh, w // kw, kw, D).mean(0)
        out.append(seq.permute(0, 2, 1, 3, 4).reshape(-1, kh * kw, D))
        start += t * h * w
    if start != x.shape[0]:
        raise ValueError(f"merge_patches: grid_thws covers {start} patches, x has {x.shape[0]}")
    return torch.cat(out) if out else x.new_zeros(0, kh * kw, D)
