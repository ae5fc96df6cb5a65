"""MXFP4 quantization-aware training of the routed experts (SPEC §3.7).

`enable_qat(model)` swaps every `RoutedExperts` module for a `FakeQuantMXExperts` that holds the
*same* Parameter objects (so optimizer state, parameter names and checkpoints are unchanged) and
runs the MX forward of `k3.model.mx_experts.MXExperts`:

    w1, w3, w2  →  fq4(w) = w + (dq(q_MXFP4(w)) − w).detach()   blocks of 32 along `in`
    z, h        →  fq8(·)  MXFP8 (E4M3) on each expert matmul's input, blocks of 32 along features

Gradients pass straight through both. Attention, shared experts, dense MLPs, the router, the
latent projections, AttnRes and lm_head are never touched. `disable_qat(model)` puts the plain
modules back. A model packed with `k3.model.mx_experts.pack_routed_experts` afterwards gives
exactly the QAT model's logits.
"""

from __future__ import annotations

import torch
from torch import nn

from k3.model.moe import RoutedExperts
from k3.model.mx_experts import MX_BLOCK, WEIGHT_FMT, MXExperts, check_mx_dims
from k3.ops.mx import fake_quant_mx

__all__ = ["FakeQuantMXExperts", "enable_qat", "disable_qat"]


class FakeQuantMXExperts(MXExperts):
    """QAT view of a RoutedExperts: same Parameters w1 [E,F,ℓ], w3 [E,F,ℓ], w2 [E,ℓ,F]."""

    def __init__(self, experts: RoutedExperts):
        super().__init__()
        check_mx_dims(experts.dim, experts.intermediate)
        self.num_experts, self.dim, self.intermediate = experts.num_experts, experts.dim, experts.intermediate
        self.act = experts.act
        self.w1, self.w3, self.w2 = experts.w1, experts.w3, experts.w2
        object.__setattr__(self, "_plain", experts)  # restored by disable_qat; not a submodule

    def expert_weights(self, experts: torch.Tensor | None = None, dtype: torch.dtype | None = None):
        ws = (self.w1, self.w3, self.w2)
        if experts is not None:
            ws = tuple(w.index_select(0, experts) for w in ws)
        return tuple(fake_quant_mx(w, WEIGHT_FMT, MX_BLOCK) for w in ws)

    def plain(self) -> RoutedExperts:
        """The original RoutedExperts, pointing at this module's current Parameters."""
        p = self._plain
        p.w1, p.w3, p.w2 = self.w1, self.w3, self.w2
        return p


def _swap(model: nn.Module, kind: type, make) -> list[str]:
    names = []
    for parent_name, parent in list(model.named_modules()):
        for child_name, child in list(parent.named_children()):
            if type(child) is kind:
                setattr(parent, child_name, make(child))
                names.append(f"{parent_name}.{child_name}" if parent_name else child_name)
    return names


def enable_qat(model: nn.Module) -> list[str]:
    """Fake-quantize the routed experts of `model` in place; returns the module names swapped.

    Idempotent: already-swapped experts are left alone.
    """
    return _swap(model, RoutedExperts, FakeQuantMXExperts)


def disable_qat(model: nn.Module) -> list[str]:
    """Undo `enable_qat` in place (the Parameters are kept); returns the module names restored."""
    return _swap(model, FakeQuantMXExperts, FakeQuantMXExperts.plain)
