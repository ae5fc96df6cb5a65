"""Parameter accounting: per-component counts, activated parameters and storage bytes.

Works on a model built on the meta device (nothing is materialised). Counts parameters and
persistent buffers (the router's ``e_score_correction_bias`` ships in checkpoints, so it counts).
The vision tower and projector of a config's ``vision_config`` (:func:`build_meta_vision`) are
counted beside the text model, never inside its total (SPEC §2 counts text, §3.9 vision).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import torch
from torch import nn

__all__ = ["ParamBreakdown", "parameter_breakdown", "build_meta_model", "build_meta_vision",
           "format_breakdown"]

MXFP4_BITS = 4.25  # 4-bit E2M1 element + one 8-bit E8M0 scale per 32 elements

_COMPONENTS = ("embedding", "lm_head", "kda_attention", "mla_attention", "dense_mlp", "router",
               "latent_projections", "routed_experts", "shared_experts", "attn_res", "norms")


def _component(name: str, kda_layers: set[int]) -> str:
    if name.startswith("model.embed_tokens"):
        return "embedding"
    if name.startswith("lm_head"):
        return "lm_head"
    if "_res_" in name:
        return "attn_res"
    if ".self_attn." in name:
        layer = int(name.split(".")[2])
        return "kda_attention" if layer in kda_layers else "mla_attention"
    if ".mlp." in name:
        return "dense_mlp"
    if ".block_sparse_moe.experts." in name:
        return "routed_experts"
    if ".block_sparse_moe.shared_experts." in name:
        return "shared_experts"
    if ".block_sparse_moe.gate." in name:
        return "router"
    if ".block_sparse_moe.routed_expert_" in name:
        return "latent_projections"
    if "norm" in name:
        return "norms"
    raise ValueError(f"parameter {name!r} belongs to no known component")


@dataclass
class ParamBreakdown:
    components: "OrderedDict[str, int]"
    total: int
    activated: int
    routed_experts: int
    bf16_bytes: int
    mxfp4_bytes: float
    vision: "OrderedDict[str, int]" = field(default_factory=OrderedDict)  # vision_tower, mm_projector

    def as_dict(self) -> dict:
        return {"components": dict(self.components), "total": self.total, "activated": self.activated,
                "routed_experts": self.routed_experts, "bf16_bytes": self.bf16_bytes,
                "mxfp4_bytes": self.mxfp4_bytes, "vision": dict(self.vision)}


def parameter_breakdown(model: nn.Module, vision: nn.Module | None = None) -> ParamBreakdown:
    """Counts by component. Activated = all but the input embedding, routed experts counted k of E.
    ``vision`` (a :class:`k3.model.vision.VisionModel`) is counted per top-level child, apart."""
    cfg = model.config
    kda = set(cfg.kda_layer_ids)
    comps: OrderedDict[str, int] = OrderedDict((c, 0) for c in _COMPONENTS)
    seen: set[int] = set()
    named = list(model.named_parameters()) + [
        (n, b) for n, b in model.named_buffers() if n.rsplit(".", 1)[-1] in _persistent_buffers(model, n)]
    for name, t in named:
        if id(t) in seen:  # tied weights count once
            continue
        seen.add(id(t))
        comps[_component(name, kda)] += t.numel()
    total = sum(comps.values())
    routed = comps["routed_experts"]
    frac = cfg.num_experts_per_token / cfg.num_experts if cfg.num_experts else 0.0
    activated = total - comps["embedding"] - routed + round(routed * frac)
    bf16 = total * 2
    mxfp4 = (total - routed) * 2 + routed * MXFP4_BITS / 8
    vis = OrderedDict((name, sum(p.numel() for p in child.parameters()))
                      for name, child in (vision.named_children() if vision is not None else ()))
    return ParamBreakdown(comps, total, activated, routed, bf16, mxfp4, vis)


def _persistent_buffers(model: nn.Module, full_name: str) -> set[str]:
    owner = model.get_submodule(full_name.rsplit(".", 1)[0]) if "." in full_name else model
    return {n for n in owner._buffers if n not in owner._non_persistent_buffers_set}


def build_meta_model(config) -> nn.Module:
    """K3ForCausalLM on the meta device: shapes only, no memory."""
    from k3.model.decoder import K3ForCausalLM

    with torch.device("meta"):
        return K3ForCausalLM(config)


def build_meta_vision(config) -> nn.Module | None:
    """The VisionModel of ``config.vision_config`` on the meta device, or None without one."""
    from k3.model.vision import VisionModel
    from k3.config.vision import vision_config_of

    vc = vision_config_of(config)
    if vc is None:
        return None
    with torch.device("meta"):
        return VisionModel(vc)


def _fmt(n: float) -> str:
    for unit, div in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= div:
            return f"{n / div:.2f}{unit}"
    return str(int(n))


def format_breakdown(b: ParamBreakdown, title: str = "") -> str:
    lines = [title] if title else []
    lines.append(f"{'component':<22}{'parameters':>20}{'share':>9}")
    for c, n in b.components.items():
        if n:
            lines.append(f"{c:<22}{n:>20,}{100 * n / b.total:>8.2f}%")
    lines.append(f"{'total':<22}{b.total:>20,}  ({_fmt(b.total)})")
    lines.append(f"{'activated per token':<22}{b.activated:>20,}  ({_fmt(b.activated)}; routed experts "
                 "counted k of E, lm_head counted, input embedding not)")
    lines.append(f"{'bytes at bf16':<22}{b.bf16_bytes:>20,}  ({b.bf16_bytes / 1e9:.1f} GB)")
    lines.append(f"{'bytes, MXFP4 experts':<22}{int(b.mxfp4_bytes):>20,}  ({b.mxfp4_bytes / 1e9:.1f} GB; routed "
                 f"experts at {MXFP4_BITS} bits, the rest bf16)")
    if b.vision:
        vis = sum(b.vision.values())
        lines.append("vision (bf16, not quantized; not in the totals above):")
        lines += [f"  {c:<20}{n:>20,}" for c, n in b.vision.items()]
        lines.append(f"  {'vision total':<20}{vis:>20,}  ({_fmt(vis)})")
        lines.append(f"{'text + vision':<22}{b.total + vis:>20,}  ({_fmt(b.total + vis)})")
    return "\n".join(lines)
