"""Routed experts in MX precision (SPEC §3.7): MXFP4 weights, MXFP8 activations.

Each routed-expert matmul y = x W^T (W [out, in] per expert) runs as

    y = fq8(x) · dq4(W)^T        fq8: MXFP8 (E4M3) fake-quant, blocks of 32 along the feature dim
                                 dq4: MXFP4 (E2M1) weights, blocks of 32 along `in`

for all three projections: gate w1 and up w3 read the expert input z [S, ℓ], down w2 reads the
activation h [S, F]. `MXExperts` holds that forward once; its subclasses only say where the
weights come from:
- `PackedMXFP4Experts` (here): uint8 buffers in the release's per-expert layout,
  `w{1,2,3}_packed` [E, out, in/2] (two E2M1 codes per byte, even element in the low nibble) and
  `w{1,2,3}_scale` [E, out, in/32] (E8M0 bytes), dequantized at matmul time for the experts that
  received tokens only. Bytes: 4.25 bits per weight, 4.25/16 of bf16.
- `FakeQuantMXExperts` (k3.train.qat): the float Parameters, fake-quantized with a straight-through
  gradient. Quantizing the same weights gives the same codes, so a packed model reproduces its QAT
  model's logits exactly.
Both keep `RoutedExperts`' call convention (`forward(x_sorted, offsets)`, `forward_capacity(x)`),
so `LatentMoE` dispatch is unchanged.
"""

from __future__ import annotations

import torch
from torch import nn

from k3.model.moe import RoutedExperts, grouped_linear
from k3.ops.mx import dequantize_fp4_packed, fake_quant_mx, pack_fp4, quantize_mx

__all__ = ["MXExperts", "PackedMXFP4Experts", "pack_routed_experts", "WEIGHT_FMT", "ACT_FMT", "MX_BLOCK"]

WEIGHT_FMT, ACT_FMT, MX_BLOCK = "fp4_e2m1", "fp8_e4m3", 32
_NAMES = ("w1", "w3", "w2")


def check_mx_dims(dim: int, intermediate: int) -> None:
    """Both matmul input widths (ℓ for w1/w3, F for w2) must hold whole MX blocks."""
    for name, n in (("expert dim ℓ", dim), ("moe_intermediate_size F", intermediate)):
        if n % MX_BLOCK:
            raise ValueError(f"MX experts need {name} to be a multiple of {MX_BLOCK}, got {n}")


class MXExperts(nn.Module):
    """Shared forward of MX routed experts; subclasses implement `expert_weights(experts, dtype)`.

    Subclasses set `num_experts`, `dim` (ℓ), `intermediate` (F) and `act` (the gated activation).
    """

    num_experts: int
    dim: int
    intermediate: int

    def expert_weights(self, experts: torch.Tensor | None = None, dtype: torch.dtype | None = None):
        """(w1, w3, w2) as MXFP4 values, for all experts or the ids in `experts` [A]."""
        raise NotImplementedError

    def forward(self, x_sorted: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """x_sorted [S, ℓ] grouped by expert, offsets [E] int32 cumulative ends -> [S, ℓ]."""
        if x_sorted.shape[0] == 0:
            return x_sorted.new_zeros(0, self.dim)
        counts = torch.diff(offsets, prepend=offsets.new_zeros(1))
        active = torch.nonzero(counts).squeeze(-1)
        if active.numel() == self.num_experts:
            experts, offs = None, offsets
        else:  # only experts with rows: decode touches k of E experts, so dequantize only those
            experts, offs = active, offsets.index_select(0, active)
        w1, w3, w2 = self.expert_weights(experts, x_sorted.dtype)
        x = fake_quant_mx(x_sorted, ACT_FMT, MX_BLOCK)
        h = self.act(grouped_linear(x, w1, offs), grouped_linear(x, w3, offs))
        return grouped_linear(fake_quant_mx(h, ACT_FMT, MX_BLOCK), w2, offs)

    def forward_capacity(self, x_ECD: torch.Tensor) -> torch.Tensor:
        """Static-shape form: x [E, C, ℓ] (expert e's slots in row e) -> [E, C, ℓ]."""
        w1, w3, w2 = (w.to(x_ECD.dtype) for w in self.expert_weights(None, x_ECD.dtype))
        x = fake_quant_mx(x_ECD, ACT_FMT, MX_BLOCK)
        h = self.act(torch.bmm(x, w1.transpose(1, 2)), torch.bmm(x, w3.transpose(1, 2)))
        return torch.bmm(fake_quant_mx(h, ACT_FMT, MX_BLOCK), w2.transpose(1, 2))

    def extra_repr(self) -> str:
        return f"num_experts={self.num_experts}, dim={self.dim}, intermediate={self.intermediate}, mx=fp4 w / fp8 a"


class PackedMXFP4Experts(MXExperts):
    """Inference experts stored as packed MXFP4: w{1,2,3}_packed uint8 [E, out, in/2], w{1,2,3}_scale
    uint8 [E, out, in/32] (w1, w3: out = F, in = ℓ; w2: out = ℓ, in = F)."""

    def __init__(self, num_experts: int, dim: int, intermediate: int, act):
        super().__init__()
        check_mx_dims(dim, intermediate)
        self.num_experts, self.dim, self.intermediate, self.act = num_experts, dim, intermediate, act
        for name, (out_f, in_f) in self._shapes().items():
            self.register_buffer(f"{name}_packed", torch.zeros(num_experts, out_f, in_f // 2, dtype=torch.uint8))
            self.register_buffer(f"{name}_scale", torch.zeros(num_experts, out_f, in_f // MX_BLOCK, dtype=torch.uint8))

    def _shapes(self) -> dict[str, tuple[int, int]]:
        f, d = self.intermediate, self.dim
        return {"w1": (f, d), "w3": (f, d), "w2": (d, f)}

    @classmethod
    @torch.no_grad()
    def from_experts(cls, experts: nn.Module) -> "PackedMXFP4Experts":
        """Quantize a RoutedExperts (or FakeQuantMXExperts) w1/w3/w2 to packed MXFP4."""
        new = cls(experts.num_experts, experts.dim, experts.intermediate, experts.act)
        for name in _NAMES:
            w = getattr(experts, name).detach()
            codes, scales = quantize_mx(w, WEIGHT_FMT, MX_BLOCK)
            getattr(new, f"{name}_packed").copy_(pack_fp4(codes))
            getattr(new, f"{name}_scale").copy_(scales)
        return new.to(getattr(experts, "w1").device)

    def expert_weights(self, experts: torch.Tensor | None = None, dtype: torch.dtype | None = None):
        out = []
        for name, (_, in_f) in self._shapes().items():
            packed, scale = getattr(self, f"{name}_packed"), getattr(self, f"{name}_scale")
            if experts is not None:
                packed, scale = packed.index_select(0, experts), scale.index_select(0, experts)
            out.append(dequantize_fp4_packed(packed, scale, in_f, MX_BLOCK, dtype=dtype or torch.float32))
        return tuple(out)

    def nbytes(self) -> int:
        """Bytes of the packed codes and scales."""
        return sum(b.numel() * b.element_size() for b in self.buffers())


def pack_routed_experts(model: nn.Module) -> list[str]:
    """Replace every routed-expert module (RoutedExperts or its QAT form) by PackedMXFP4Experts, in
    place. Returns the qualified names replaced. Nothing else in the model changes."""
    names = []
    for parent_name, parent in list(model.named_modules()):
        for child_name, child in list(parent.named_children()):
            if isinstance(child, RoutedExperts) or (isinstance(child, MXExperts) and hasattr(child, "w1")):
                setattr(parent, child_name, PackedMXFP4Experts.from_experts(child))
                names.append(f"{parent_name}.{child_name}" if parent_name else child_name)
    return names
