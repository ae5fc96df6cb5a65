"""Routed experts in MX precision (SPEC §3.7): MXFP4 weights, optional MXFP8 activations.

Each routed-expert matmul y = x W^T (W [out, in] per expert) runs as

    y = a(x) · dq4(W)^T          dq4: MXFP4 (E2M1) weights, blocks of 32 along `in`
                                 a:   MXFP8 (E4M3) fake-quant, blocks of 32 along the feature dim,
                                      when `act_fmt` is "fp8_e4m3"; the identity when it is None

for all three projections: gate w1 and up w3 read the expert input z [S, ℓ], down w2 reads the
activation h [S, F]. `act_fmt` follows the checkpoint's `quantization_config.input_activations`
(null in the release: weights-only) or the QAT recipe (MXFP8). `MXExperts` holds that forward once;
its subclasses only say where the weights come from:
- `PackedMXFP4Experts`: uint8 buffers in the release's per-expert layout,
  `w{1,2,3}_packed` [E, out, in/2] (two E2M1 codes per byte, even element in the low nibble) and
  `w{1,2,3}_scale` [E, out, in/32] (E8M0 bytes), dequantized at matmul time for the experts that
  received tokens only. Bytes: 4.25 bits per weight, 4.25/16 of bf16.
- `FakeQuantMXExperts`: the float Parameters of a RoutedExperts, fake-quantized with a
  straight-through gradient (QAT, `k3.train.qat`; also the dequantized load of a checkpoint that
  declares MXFP8 activations). Quantizing the same weights gives the same codes, so a packed model
  reproduces its QAT model's logits exactly.
Both keep `RoutedExperts`' call convention (`forward(x_sorted, offsets)`, `forward_capacity(x)`),
so `LatentMoE` dispatch is unchanged. `swap_modules` is the one module-replacement loop used by
QAT, packing and packed loading.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from k3.model.moe import RoutedExperts, grouped_linear
from k3.ops.mx import dequantize_fp4_packed, fake_quant_mx, pack_fp4, quantize_mx

__all__ = ["MXExperts", "PackedMXFP4Experts", "FakeQuantMXExperts", "pack_routed_experts", "swap_modules",
           "routed_expert_names", "WEIGHT_FMT", "ACT_FMT", "MX_BLOCK", "FROM_SOURCE"]

WEIGHT_FMT, ACT_FMT, MX_BLOCK = "fp4_e2m1", "fp8_e4m3", 32
ACT_FMTS = (None, ACT_FMT)
FROM_SOURCE = "from-source"  # pack_routed_experts: keep each source module's activation format
_NAMES = ("w1", "w3", "w2")


def check_mx_dims(dim: int, intermediate: int) -> None:
    """Both matmul input widths (ℓ for w1/w3, F for w2) must hold whole MX blocks."""
    for name, n in (("expert dim ℓ", dim), ("moe_intermediate_size F", intermediate)):
        if n % MX_BLOCK:
            raise ValueError(f"MX experts need {name} to be a multiple of {MX_BLOCK}, got {n}")


def _check_act_fmt(act_fmt: str | None) -> str | None:
    if act_fmt not in ACT_FMTS:
        raise ValueError(f"MX experts: act_fmt must be one of {ACT_FMTS}, got {act_fmt!r}")
    return act_fmt


def swap_modules(model: nn.Module, kinds: tuple[type, ...], make: Callable[[nn.Module], nn.Module]) -> list[str]:
    """Replace, in place, every submodule whose exact type is in `kinds` by `make(child)`.

    Exact type, not isinstance: a subclass is a different module and is left alone (so packed
    experts, themselves MX experts, are never re-swapped). Returns the qualified names replaced.
    """
    names = []
    for parent_name, parent in list(model.named_modules()):
        for child_name, child in list(parent.named_children()):
            if type(child) in kinds:
                setattr(parent, child_name, make(child))
                names.append(f"{parent_name}.{child_name}" if parent_name else child_name)
    return names


class MXExperts(nn.Module):
    """Shared forward of MX routed experts; subclasses implement `expert_weights(experts, dtype)`.

    Subclasses set `num_experts`, `dim` (ℓ), `intermediate` (F), `act` (the gated activation) and
    `act_fmt` (None or "fp8_e4m3": the fake-quant applied to each expert matmul's input).
    """

    num_experts: int
    dim: int
    intermediate: int
    act_fmt: str | None = None

    def expert_weights(self, experts: torch.Tensor | None = None, dtype: torch.dtype | None = None):
        """(w1, w3, w2) as MXFP4 values, for all experts or the ids in `experts` [A]."""
        raise NotImplementedError

    def _act_quant(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.act_fmt is None else fake_quant_mx(x, self.act_fmt, MX_BLOCK)

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
        x = self._act_quant(x_sorted)
        h = self.act(grouped_linear(x, w1, offs), grouped_linear(x, w3, offs))
        return grouped_linear(self._act_quant(h), w2, offs)

    def forward_capacity(self, x_ECD: torch.Tensor) -> torch.Tensor:
        """Static-shape form: x [E, C, ℓ] (expert e's slots in row e) -> [E, C, ℓ]."""
        w1, w3, w2 = (w.to(x_ECD.dtype) for w in self.expert_weights(None, x_ECD.dtype))
        x = self._act_quant(x_ECD)
        h = self.act(torch.bmm(x, w1.transpose(1, 2)), torch.bmm(x, w3.transpose(1, 2)))
        return torch.bmm(self._act_quant(h), w2.transpose(1, 2))

    def extra_repr(self) -> str:
        act = "fp8" if self.act_fmt else "unquantized"
        return (f"num_experts={self.num_experts}, dim={self.dim}, intermediate={self.intermediate}, "
                f"mx=fp4 w / {act} a")


class PackedMXFP4Experts(MXExperts):
    """Inference experts stored as packed MXFP4: w{1,2,3}_packed uint8 [E, out, in/2], w{1,2,3}_scale
    uint8 [E, out, in/32] (w1, w3: out = F, in = ℓ; w2: out = ℓ, in = F)."""

    def __init__(self, num_experts: int, dim: int, intermediate: int, act, act_fmt: str | None = None):
        super().__init__()
        check_mx_dims(dim, intermediate)
        self.num_experts, self.dim, self.intermediate, self.act = num_experts, dim, intermediate, act
        self.act_fmt = _check_act_fmt(act_fmt)
        for name, (out_f, in_f) in self._shapes().items():
            self.register_buffer(f"{name}_packed", torch.zeros(num_experts, out_f, in_f // 2, dtype=torch.uint8))
            self.register_buffer(f"{name}_scale", torch.zeros(num_experts, out_f, in_f // MX_BLOCK, dtype=torch.uint8))

    def _shapes(self) -> dict[str, tuple[int, int]]:
        f, d = self.intermediate, self.dim
        return {"w1": (f, d), "w3": (f, d), "w2": (d, f)}

    @classmethod
    def empty_like(cls, experts: nn.Module, act_fmt: str | None) -> "PackedMXFP4Experts":
        """Zero bytes of `experts`' shape on its device (to be filled from a checkpoint)."""
        with torch.device(experts.w1.device):
            return cls(experts.num_experts, experts.dim, experts.intermediate, experts.act, act_fmt)

    @classmethod
    @torch.no_grad()
    def from_experts(cls, experts: nn.Module, act_fmt: str | None | object = FROM_SOURCE) -> "PackedMXFP4Experts":
        """Quantize a RoutedExperts (or FakeQuantMXExperts) w1/w3/w2 to packed MXFP4.

        `act_fmt`: FROM_SOURCE keeps the source's (None for RoutedExperts, MXFP8 for QAT)."""
        if act_fmt == FROM_SOURCE:
            act_fmt = getattr(experts, "act_fmt", None)
        new = cls(experts.num_experts, experts.dim, experts.intermediate, experts.act, act_fmt)
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


class FakeQuantMXExperts(MXExperts):
    """MX view of a RoutedExperts: the same Parameters w1 [E,F,ℓ], w3 [E,F,ℓ], w2 [E,ℓ,F], used as
    fq4(w) = w + (dq(q_MXFP4(w)) − w).detach(); activations per `act_fmt` (QAT: MXFP8)."""

    def __init__(self, experts: RoutedExperts, act_fmt: str | None = ACT_FMT):
        super().__init__()
        check_mx_dims(experts.dim, experts.intermediate)
        self.num_experts, self.dim, self.intermediate = experts.num_experts, experts.dim, experts.intermediate
        self.act, self.act_fmt = experts.act, _check_act_fmt(act_fmt)
        self.w1, self.w3, self.w2 = experts.w1, experts.w3, experts.w2
        object.__setattr__(self, "_plain", experts)  # restored by plain(); not a submodule

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


FLOAT_EXPERTS = (RoutedExperts, FakeQuantMXExperts)  # routed experts that hold float Parameters


def routed_expert_names(model: nn.Module) -> list[str]:
    """Qualified names of every routed-expert module (float, QAT or packed) in `model`."""
    kinds = FLOAT_EXPERTS + (PackedMXFP4Experts,)
    return [n for n, m in model.named_modules() if type(m) in kinds]


def pack_routed_experts(model: nn.Module, act_fmt: str | None | object = FROM_SOURCE) -> list[str]:
    """Replace every float routed-expert module (RoutedExperts or its QAT form) by
    PackedMXFP4Experts, in place. `act_fmt`: FROM_SOURCE keeps each module's activation format
    (a QAT model packs to MXFP8 activations, a plain one to weights-only), or set it explicitly.
    Returns the qualified names replaced. Nothing else in the model changes."""
    if act_fmt != FROM_SOURCE:
        _check_act_fmt(act_fmt)
    return swap_modules(model, FLOAT_EXPERTS, lambda m: PackedMXFP4Experts.from_experts(m, act_fmt))
