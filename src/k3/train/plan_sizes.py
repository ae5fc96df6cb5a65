"""Sizes the plan is built from: checkpoint bytes, the vision tower, the optimizer split (docs/PLAN.md §1-3).

* :func:`checkpoint_bytes` — the one computation of a text checkpoint's size: every tensor of
  :func:`k3.checkpoint.names.expected_tensors` at its storage dtype (bf16, the few fp32 tensors of
  SPEC §4), routed experts optionally packed MXFP4 (uint8 [out, in/2] + uint8 scales [out, in/32]:
  exactly 17/32 byte = 4.25 bits per weight).
* :func:`vision_tensor_shapes` — the MoonViT-3D tower + PatchMergerV2 projector of a ``vision_config``
  (the release's field names), enumerated tensor by tensor; the k3 text model has no vision module,
  so this is what the released checkpoint holds beyond the text tensors.
* :func:`param_split` — parameter counts by what the optimizer keeps for them
  (:func:`k3.train.optim.classify_param` on the meta-device model) and by layer.
"""

from __future__ import annotations

import math

import torch

from k3.errors import ConfigError

__all__ = ["RELEASE_CHECKPOINT_GIB", "RELEASE_SHARDS", "RELEASE_VISION_CONFIG", "checkpoint_bytes",
           "vision_tensor_shapes", "vision_bytes", "param_split"]

RELEASE_CHECKPOINT_GIB = 1453.7  # the released K3 checkpoint: 96 safetensors shards
RELEASE_SHARDS = 96
# The released checkpoint's vision_config (the fields that set tensor shapes), as published with it.
RELEASE_VISION_CONFIG = {
    "patch_size": 14, "vt_hidden_size": 1024, "vt_intermediate_size": 4096, "vt_num_hidden_layers": 27,
    "vt_num_attention_heads": 12, "qkv_hidden_size": 1536, "init_pos_emb_height": 64,
    "init_pos_emb_width": 64, "merge_kernel_size": [2, 2], "mm_projector_type": "patchmergerv2",
    "text_hidden_size": 7168, "attn_bias": False, "linear_bias": False, "patch_embed_proj_bias": False,
}


def checkpoint_bytes(config, packed: bool = True, dtype: torch.dtype = torch.bfloat16) -> dict[str, int]:
    """``{"experts", "other", "total"}`` bytes of the text checkpoint (routed experts MXFP4 if ``packed``)."""
    from k3.checkpoint.names import expected_tensors, is_stacked_expert

    out = {"experts": 0, "other": 0}
    for name, (shape, dt) in expected_tensors(config, dtype, packed=packed).items():
        out["experts" if is_stacked_expert(name) else "other"] += math.prod(shape) * dt.itemsize
    out["total"] = out["experts"] + out["other"]
    return out


def vision_tensor_shapes(vc: dict) -> dict[str, tuple[int, ...]]:
    """Tensor shapes of the vision tower + projector described by ``vc`` (release field names).

    patch embed Conv2d(3, D, p) and a learned [h0, w0, D] position table; per block RMSNorm ×2,
    wqkv [3Q, D], wo [D, Q], fc0 [I, D], fc1 [D, I]; a final RMSNorm; projector linear_1
    [m²D, m²D], linear_2 [H_text, m²D], post RMSNorm [H_text]. Biases only where the config asks.
    A field the config leaves out (or null) takes the release's value, as its configuration class does.
    """
    if vc.get("mm_projector_type", "patchmergerv2") != "patchmergerv2":
        raise ConfigError(f"vision_config.mm_projector_type={vc.get('mm_projector_type')!r}: only "
                          "'patchmergerv2' (the release's) is counted")
    g = {**RELEASE_VISION_CONFIG, **{k: v for k, v in vc.items() if v is not None}}  # absent: release values
    D, I, Q, p = g["vt_hidden_size"], g["vt_intermediate_size"], g["qkv_hidden_size"], g["patch_size"]
    mh, mw = g["merge_kernel_size"]
    M, Ht = mh * mw * g.get("mm_hidden_size", D), g["text_hidden_size"]
    s: dict[str, tuple[int, ...]] = {"vision_tower.patch_embed.proj.weight": (D, 3, p, p),
                                     "vision_tower.patch_embed.pos_emb.weight":
                                         (g["init_pos_emb_height"], g["init_pos_emb_width"], D)}
    if g["patch_embed_proj_bias"]:
        s["vision_tower.patch_embed.proj.bias"] = (D,)
    for b in range(g["vt_num_hidden_layers"]):
        pre = f"vision_tower.encoder.blocks.{b}."
        s.update({pre + "norm0.weight": (D,), pre + "norm1.weight": (D,), pre + "wqkv.weight": (3 * Q, D),
                  pre + "wo.weight": (D, Q), pre + "mlp.fc0.weight": (I, D), pre + "mlp.fc1.weight": (D, I)})
        if g["attn_bias"]:
            s.update({pre + "wqkv.bias": (3 * Q,), pre + "wo.bias": (D,)})
        if g["linear_bias"]:
            s.update({pre + "mlp.fc0.bias": (I,), pre + "mlp.fc1.bias": (D,)})
    s.update({"vision_tower.encoder.final_layernorm.weight": (D,), "mm_projector.linear_1.weight": (M, M),
              "mm_projector.linear_2.weight": (Ht, M), "mm_projector.post_norm.weight": (Ht,)})
    return s


def vision_bytes(vc: dict | None, itemsize: int = 2) -> int:
    """Bytes of the vision tower + projector of ``vc`` at ``itemsize`` (0 without a vision_config)."""
    if not vc:
        return 0
    return sum(math.prod(s) for s in vision_tensor_shapes(vc).values()) * itemsize


_SPLITS: dict[tuple, dict] = {}  # config fingerprint -> split (building the k3 meta model takes seconds)


def _split(config) -> dict:
    from k3.model.summary import build_meta_model
    from k3.train.optim import classify_param
    from k3.train.plan_activations import _sources

    model = build_meta_model(config)
    out = dict.fromkeys(("muon", "muon_experts", "adamw", "routed_experts", "parameters", "embedding"), 0)
    layers: dict[int, list[int]] = {}   # layer -> [non-expert, routed expert] parameters
    names = set()
    for name, p in model.named_parameters():
        names.add(name)
        kind, _ = classify_param(name, p, config)
        n, expert = p.numel(), ".experts." in name
        out["parameters"] += n
        out[kind if kind in ("muon", "muon_experts") else "muon" if kind.startswith("muon") else "adamw"] += n
        out["routed_experts"] += n if expert else 0
        out["embedding"] += n if name.startswith("model.embed_tokens") else 0
        if name.startswith("model.layers."):
            layers.setdefault(int(name.split(".")[2]), [0, 0])[1 if expert else 0] += n
    # An AttnRes mix over one source returns it unchanged (layer 0's attention mix): its pseudo-query
    # and key norm get no gradient, hence no gradient memory and no (AdamW) optimizer state.
    out["no_grad"] = sum(2 * config.hidden_size for l in range(config.num_hidden_layers)
                         if config.attn_res_block_size is not None and _sources(config, l)[0] < 2)
    out["adamw"] -= out["no_grad"]
    out["buffers"] = sum(t.numel() for n, t in model.state_dict().items() if n not in names)  # persistent only
    out["total"] = out["parameters"] + out["buffers"]
    out["non_expert"] = out["total"] - out["routed_experts"]
    # activated per token: everything but the input embedding, routed experts counted k of E
    E = config.num_experts
    out["activated"] = out["total"] - out["embedding"] - out["routed_experts"] + (
        out["routed_experts"] * config.num_experts_per_token // E if E else 0)
    out["layers"] = [tuple(layers[l]) for l in sorted(layers)]
    return out


def param_split(config) -> dict:
    """Counts: ``parameters``, ``buffers`` (persistent: the router biases), ``total`` (both, what a
    checkpoint holds), ``routed_experts``, ``non_expert``; by optimizer state: ``muon``
    (2-D matrices, per-head blocks included: one momentum buffer), ``muon_experts`` (expert stacks,
    momentum), ``adamw`` (embeddings, lm_head, router, norms, biases, conv, A_log, dt_bias, AttnRes:
    two moments; parameters that never get a gradient, ``no_grad``, excluded); ``activated`` (per
    token: routed experts k of E, input embedding not); ``layers`` [(non-expert, routed-expert)
    parameters per decoder layer]."""
    key = config.fingerprint()
    if key not in _SPLITS:
        _SPLITS[key] = _split(config)
    return _SPLITS[key]
