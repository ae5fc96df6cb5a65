"""A dense nanoGPT-style transformer: the baseline K3 is compared with in benchmarks/train.py.

Pre-LayerNorm blocks of causal multi-head self-attention (fused qkv, no biases) and a 4x GELU MLP,
learned absolute positions, an untied lm_head; nanoGPT's init (normal 0.02, residual
projections 0.02 / sqrt(2 L)). ``active_params`` counts what K3's ``parameter_breakdown`` counts as
activated for K3: every parameter but the input embeddings (token and position), lm_head included.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, d: int, n_head: int, n_layer: int):
        super().__init__()
        self.n_head = n_head
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.proj = nn.Linear(d, d, bias=False)
        self.fc = nn.Linear(d, 4 * d, bias=False)
        self.out = nn.Linear(4 * d, d, bias=False)
        for lin in (self.proj, self.out):
            lin.residual = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, D = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(B, T, 3, self.n_head, D // self.n_head).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(B, T, D))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class DenseGPT(nn.Module):
    def __init__(self, vocab: int, d: int, n_layer: int, n_head: int, max_len: int):
        super().__init__()
        if d % n_head:
            raise ValueError(f"width {d} is not a multiple of {n_head} heads")
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(max_len, d)
        self.blocks = nn.ModuleList(Block(d, n_head, n_layer) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                std = 0.02 / math.sqrt(2 * n_layer) if getattr(m, "residual", False) else 0.02
                nn.init.normal_(m.weight, 0.0, std)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """[B, T] token ids -> [B, T, V] logits."""
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for b in self.blocks:
            x = b(x)
        return self.lm_head(self.ln_f(x))

    def active_params(self) -> int:
        return sum(p.numel() for p in self.parameters()) - self.wte.weight.numel() - self.wpe.weight.numel()


def dense_active_params(vocab: int, d: int, n_layer: int) -> int:
    """Closed form of DenseGPT.active_params: L (12 d^2 + 4 d) + 2 d + V d."""
    return n_layer * (12 * d * d + 4 * d) + 2 * d + vocab * d


def matching_width(target: int, vocab: int, n_layer: int, n_head: int) -> int:
    """The width (a multiple of 4 * n_head, so heads have a multiple-of-4 size) whose DenseGPT of
    ``n_layer`` layers has active parameters closest to ``target``."""
    step = 4 * n_head
    return min(range(step, 4097, step), key=lambda d: abs(dense_active_params(vocab, d, n_layer) - target))


def adamw_for(model: DenseGPT, lr: float, weight_decay: float = 0.1) -> torch.optim.AdamW:
    """nanoGPT's AdamW: decay on >= 2-D weights, none on norms; betas (0.9, 0.95)."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                              {"params": rest, "weight_decay": 0.0}], lr=lr, betas=(0.9, 0.95))
