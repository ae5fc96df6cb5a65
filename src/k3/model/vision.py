"""The MoonViT3d vision tower and the ``patchmergerv2`` projector (SPEC §3.9); math in :mod:`k3.ops.vision`.

    x   = patch_embed.proj(pixels) + pos_emb(grid)                  [N, D]   (N patches, packed)
    x  += wo( attn_within_item( rope_2d( wqkv(norm0(x)) ) ) )        ×L blocks, pre-norm
    x  += fc1( gelu_tanh( fc0(norm1(x)) ) )
    m   = merge_kh×kw( final_layernorm(x) ), mean over t              [M, kh·kw, D]
    out = post_norm( proj.2( gelu( proj.0( m.flatten(1) ) ) ) )      [M, text_hidden_size]

Tensor names are the release's: ``vision_tower.patch_embed.{proj,pos_emb}``,
``vision_tower.encoder.blocks.{n}.{norm0,wqkv,wo,norm1,mlp.fc0,mlp.fc1}``,
``vision_tower.encoder.final_layernorm``, ``mm_projector.{proj.0,proj.2,post_norm}``. ``wqkv`` rows
are [q | k | v], each head-major (head n owns rows n·d … n·d+d−1); ``wo`` reads heads head-major.
Norms are weight-only RMSNorm (the tower's eps is ``finfo(float32).eps``, the projector's
``projector_ln_eps``); biases only where the config asks (none in K3).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from k3.model.norm import RMSNorm
from k3.ops.vision import (cu_seqlens, grid_list, merge_patches, patch_positions, pos_embedding, rope_2d,
                           varlen_attention)
from k3.config.vision import ROPE_THETA, TOWER_NORM_EPS, VisionConfig

__all__ = ["VisionTower", "VisionProjector", "VisionModel", "VisionBlock", "PatchEmbed", "INIT_STD"]

INIT_STD = 0.02  # the vision_config has no initializer_range; the text model's default


@torch.no_grad()
def _init_linear(*layers: nn.Module) -> None:
    for lin in layers:
        nn.init.normal_(lin.weight, 0.0, INIT_STD)
        if lin.bias is not None:
            nn.init.zeros_(lin.bias)


class PosEmb(nn.Module):
    """Learned [H0, W0, D] table (``weight``), resized per item; sin/cos time term for t > 1."""

    def __init__(self, vc: VisionConfig):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vc.init_pos_emb_height, vc.init_pos_emb_width, vc.vt_hidden_size))
        self.mode, self.max_t = vc.pos_emb_interpolation_mode, vc.init_pos_emb_time
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, 0.0, INIT_STD)

    def forward(self, grid_thws) -> torch.Tensor:
        """-> [N, D] position term of the packed items."""
        return pos_embedding(self.weight, grid_thws, self.mode, self.max_t)


class PatchEmbed(nn.Module):
    """``proj``: Conv2d(3, D, kernel = stride = patch) on [N, 3, p, p] patches, plus ``pos_emb``."""

    def __init__(self, vc: VisionConfig):
        super().__init__()
        p = vc.patch_size
        self.proj = nn.Conv2d(3, vc.vt_hidden_size, kernel_size=p, stride=p, bias=vc.patch_embed_proj_bias)
        self.pos_emb = PosEmb(vc)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        _init_linear(self.proj)

    def forward(self, pixel_values: torch.Tensor, grid_thws) -> torch.Tensor:
        """pixel_values [N, 3, p, p] -> [N, D]."""
        x = self.proj(pixel_values.to(self.proj.weight.dtype)).flatten(1)
        return x + self.pos_emb(grid_thws).to(x.dtype)


class VisionMLP(nn.Module):
    """fc1(gelu_tanh(fc0(x))): D -> vt_intermediate_size -> D."""

    def __init__(self, vc: VisionConfig):
        super().__init__()
        self.fc0 = nn.Linear(vc.vt_hidden_size, vc.vt_intermediate_size, bias=vc.linear_bias)
        self.fc1 = nn.Linear(vc.vt_intermediate_size, vc.vt_hidden_size, bias=vc.linear_bias)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        _init_linear(self.fc0, self.fc1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc1(F.gelu(self.fc0(x), approximate="tanh"))


class VisionBlock(nn.Module):
    """Pre-norm block: 2-D RoPE attention within each item, then the MLP."""

    def __init__(self, vc: VisionConfig):
        super().__init__()
        D, Q = vc.vt_hidden_size, vc.qkv_hidden_size
        self.heads, self.head_dim = vc.vt_num_attention_heads, vc.head_dim
        self.norm0 = RMSNorm(D, TOWER_NORM_EPS)
        self.wqkv = nn.Linear(D, 3 * Q, bias=vc.attn_bias)
        self.wo = nn.Linear(Q, D, bias=vc.attn_bias)
        self.norm1 = RMSNorm(D, TOWER_NORM_EPS)
        self.mlp = VisionMLP(vc)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        _init_linear(self.wqkv, self.wo)

    def forward(self, x: torch.Tensor, pos: torch.Tensor, cu: torch.Tensor) -> torch.Tensor:
        """x [N, D], pos [N, 2] (row, col), cu [n + 1] segment starts -> [N, D]."""
        N = x.shape[0]
        q, k, v = self.wqkv(self.norm0(x)).view(N, 3, self.heads, self.head_dim).unbind(1)
        q, k = rope_2d(q, pos, ROPE_THETA), rope_2d(k, pos, ROPE_THETA)
        x = x + self.wo(varlen_attention(q, k, v, cu).reshape(N, self.heads * self.head_dim))
        return x + self.mlp(self.norm1(x))


class VisionEncoder(nn.Module):
    """``blocks`` then ``final_layernorm``."""

    def __init__(self, vc: VisionConfig):
        super().__init__()
        self.blocks = nn.ModuleList(VisionBlock(vc) for _ in range(vc.vt_num_hidden_layers))
        self.final_layernorm = RMSNorm(vc.vt_hidden_size, TOWER_NORM_EPS)

    def forward(self, x: torch.Tensor, pos: torch.Tensor, cu: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x, pos, cu)
        return self.final_layernorm(x)


class VisionTower(nn.Module):
    """MoonViT3d: packed patches -> merged tokens [M, kh·kw, D] (``vision_tower``)."""

    def __init__(self, vc: VisionConfig):
        super().__init__()
        self.config = vc
        self.patch_embed = PatchEmbed(vc)
        self.encoder = VisionEncoder(vc)

    def forward(self, pixel_values: torch.Tensor, grid_thws) -> torch.Tensor:
        """pixel_values [N, 3, p, p] (items packed, each frame-major then row-major), grid_thws [n, 3]
        -> [M, kh·kw, D], M = Σ (h/kh)(w/kw), merged tokens row-major per item, items in order."""
        grid = grid_list(grid_thws)
        self._check(pixel_values, grid)
        dev = pixel_values.device
        x = self.patch_embed(pixel_values, grid)
        x = self.encoder(x, patch_positions(grid, dev), cu_seqlens(grid, dev))
        return merge_patches(x, grid, self.config.merge_kernel_size)

    def _check(self, pixel_values: torch.Tensor, grid: list[tuple[int, int, int]]) -> None:
        p, (kh, kw) = self.config.patch_size, self.config.merge_kernel_size
        if pixel_values.dim() != 4 or tuple(pixel_values.shape[1:]) != (3, p, p):
            raise ValueError(f"pixel_values must be [N, 3, {p}, {p}], got {tuple(pixel_values.shape)}")
        n = sum(t * h * w for t, h, w in grid)
        if n != pixel_values.shape[0]:
            raise ValueError(f"grid_thws covers {n} patches but pixel_values has {pixel_values.shape[0]}")
        for t, h, w in grid:
            if h % kh or w % kw:
                raise ValueError(f"grid (t={t}, h={h}, w={w}) is not a multiple of the {kh}x{kw} merge kernel")


class VisionProjector(nn.Module):
    """``patchmergerv2`` (``mm_projector``): Linear, GELU (erf), Linear, RMSNorm; no pre-norm, no bias."""

    def __init__(self, vc: VisionConfig):
        super().__init__()
        M = vc.projector_dim
        self.proj = nn.Sequential(nn.Linear(M, M, bias=False), nn.GELU(),
                                  nn.Linear(M, vc.text_hidden_size, bias=False))
        self.post_norm = RMSNorm(vc.text_hidden_size, vc.projector_ln_eps)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        _init_linear(self.proj[0], self.proj[2])

    def forward(self, merged: torch.Tensor) -> torch.Tensor:
        """merged [M, kh·kw, D] (member k in channels [k·D, (k+1)·D)) or [M, kh·kw·D] -> [M, text_hidden]."""
        return self.post_norm(self.proj(merged.flatten(1)))


class VisionModel(nn.Module):
    """``vision_tower`` + ``mm_projector``: pixels -> the rows that replace ``<|media_pad|>`` embeddings."""

    def __init__(self, vc: VisionConfig):
        super().__init__()
        self.config = vc
        self.vision_tower = VisionTower(vc)
        self.mm_projector = VisionProjector(vc)

    def forward(self, pixel_values: torch.Tensor, grid_thws) -> torch.Tensor:
        """pixel_values [N, 3, p, p], grid_thws [n, 3] -> [M, text_hidden_size]."""
        return self.mm_projector(self.vision_tower(pixel_values, grid_thws))

    def split(self, rows: torch.Tensor, grid_thws) -> list[torch.Tensor]:
        """Rows of :meth:`forward` -> one [(h/kh)(w/kw), ·] tensor per item."""
        kh, kw = self.config.merge_kernel_size
        return list(rows.split([(h // kh) * (w // kw) for _, h, w in grid_list(grid_thws)]))

    @torch.no_grad()
    def init_weights(self) -> "VisionModel":
        """(Re-)initialise every tensor as construction does (after ``to_empty``); returns self."""
        for m in self.modules():
            if type(m).__module__.startswith("k3.") and hasattr(m, "reset_parameters"):
                m.reset_parameters()
        return self
