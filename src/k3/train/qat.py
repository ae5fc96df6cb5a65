"""MXFP4 quantization-aware training of the routed experts (SPEC §3.7).

`enable_qat(model)` swaps every `RoutedExperts` module for a `FakeQuantMXExperts`
(`k3.model.mx_experts`) that holds the *same* Parameter objects (so optimizer state, parameter
names and checkpoints are unchanged) and runs the MX forward:

    w1, w3, w2  →  fq4(w) = w + (dq(q_MXFP4(w)) − w).detach()   blocks of 32 along `in`
    z, h        →  fq8(·)  MXFP8 (E4M3) on each expert matmul's input, blocks of 32 along features

Gradients pass straight through both. Attention, shared experts, dense MLPs, the router, the
latent projections, AttnRes and lm_head are never touched. `disable_qat(model)` puts the plain
modules back. A model packed with `k3.model.mx_experts.pack_routed_experts` afterwards (or
exported by `k3 quantize`, which then declares MXFP8 input activations) gives exactly the QAT
model's logits. Both swaps go through `k3.model.mx_experts.swap_modules`.
"""

from __future__ import annotations

from torch import nn

from k3.model.moe import RoutedExperts
from k3.model.mx_experts import ACT_FMT, FakeQuantMXExperts, swap_modules

__all__ = ["FakeQuantMXExperts", "enable_qat", "disable_qat"]


def enable_qat(model: nn.Module) -> list[str]:
    """Fake-quantize the routed experts of `model` in place; returns the module names swapped.

    Idempotent: already-swapped experts are left alone.
    """
    return swap_modules(model, (RoutedExperts,), lambda m: FakeQuantMXExperts(m, ACT_FMT))


def disable_qat(model: nn.Module) -> list[str]:
    """Undo `enable_qat` in place (the Parameters are kept); returns the module names restored."""
    return swap_modules(model, (FakeQuantMXExperts,), FakeQuantMXExperts.plain)
