"""Gated MLP: the dense layer MLP and the MoE shared experts (SPEC §3.4).

    y = down_proj( act(gate_proj(x), up_proj(x)) )      x [..., H] -> [..., H]

act is SiTU (`hidden_act='situ'`) or SwiGLU (`'silu'`), chosen by `glu_act(config)`. The dense MLP
has width intermediate_size; the shared experts are one GatedMLP of width
num_shared_experts·moe_intermediate_size (state-dict names `{gate,up,down}_proj.weight`).
"""

from __future__ import annotations

import torch
from torch import nn

from k3.ops.situ import glu_act

__all__ = ["GatedMLP"]


class GatedMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, config):
        super().__init__()
        if hidden_size <= 0 or intermediate_size <= 0:
            raise ValueError(f"GatedMLP needs positive sizes, got hidden_size={hidden_size}, "
                             f"intermediate_size={intermediate_size}")
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.act = glu_act(config)
        self.hidden_act = config.hidden_act
        self.init_std = getattr(config, "initializer_range", 0.02)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """gate/up/down ~ N(0, initializer_range)."""
        for lin in (self.gate_proj, self.up_proj, self.down_proj):
            nn.init.normal_(lin.weight, 0.0, self.init_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.hidden_size:
            raise ValueError(f"GatedMLP expected hidden size {self.hidden_size} in the last dimension, "
                             f"got input shape {tuple(x.shape)}")
        return self.down_proj(self.act(self.gate_proj(x), self.up_proj(x)))

    def extra_repr(self) -> str:
        return f"hidden={self.hidden_size}, intermediate={self.intermediate_size}, act={self.hidden_act}"
