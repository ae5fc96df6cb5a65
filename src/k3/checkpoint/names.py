"""The one place that knows checkpoint tensor names (SPEC §4, docs/INTERFACES.md).

Inside k3 the state-dict names are the HF names except that routed experts are stacked
(``block_sparse_moe.experts.w1`` [E, F, ℓ]). On disk every supported layout is mapped onto those
internal names by :func:`resolve`:

* k3 / K3 release:   ``...experts.{e}.w{1,2,3}.weight`` (one expert each), optionally prefixed
  ``language_model.`` (multimodal release) and optionally packed MXFP4
  (``.weight_packed`` uint8 [out, in/2] + ``.weight_scale`` uint8 [out, in/32]);
  a model whose experts stay packed in memory (``PackedMXFP4Experts``) holds them stacked as
  ``experts.w{1,2,3}_packed`` [E, out, in/2] and ``experts.w{1,2,3}_scale`` [E, out, in/32];
* Kimi-Linear (Moonshot or transformers' ``save_pretrained``): the dense layer-0 MLP may sit under
  ``block_sparse_moe.`` and ``A_log`` is stored [1, 1, nh, 1]; the K3 release pads ``A_log`` to 128.
* K3's vision tower and projector (multimodal release): ``vision_tower.…`` / ``mm_projector.…``,
  unprefixed, the same names on disk and in ``K3VLForConditionalGeneration``
  (:func:`expected_vision_tensors`); a text-only load ignores them (and other families' vision
  tensors, ``_VISION_PREFIXES``).

:func:`expected_tensors` is the validation source of truth for both loading and saving;
:func:`mxfp4_quantization_config` is the compressed-tensors ``quantization_config`` that names,
by the same names, what a packed checkpoint quantizes (the routed experts) and what it does not.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from k3.config import K3Config
from k3.errors import CheckpointError
from k3.model.mx_experts import ACT_FMT  # the one MX activation format k3 runs (MXFP8 E4M3)
from k3.config.vision import VisionConfig

__all__ = ["expected_tensors", "keeps_fp32", "storage_dtype", "file_names", "resolve", "Target", "check_file_shape",
           "to_internal", "is_stacked_expert", "is_packed_buffer", "holds_packed_experts", "stores_packed_experts",
           "mxfp4_quantization_config", "is_mxfp4_quantization", "declared_act_fmt", "MXFP4_FORMAT",
           "MXFP8_INPUT_ACTIVATIONS", "ACT_FMT", "QUANT_CONFIG_KEY",
           "TEXT_PREFIX", "MX_BLOCK", "VISION_PREFIXES", "is_vision_tensor", "expected_vision_tensors", "not_text",
           "MXFP4_VISION_IGNORE"]

TEXT_PREFIX = "language_model."
MX_BLOCK = 32  # OCP MX block size along the input dimension
_VISION_PREFIXES = ("vision_tower.", "vision_model.", "multi_modal_projector.", "mm_projector.", "visual.")
VISION_PREFIXES = ("vision_tower.", "mm_projector.")  # K3's own vision tensors (stored unprefixed)
# Tensors the release stores in fp32 whatever the model dtype (SPEC §4).
_FP32_SUFFIXES = ("_conv1d.weight", ".A_log", ".dt_bias", ".o_norm.weight", ".e_score_correction_bias")
_EXPERT_RE = re.compile(r"^(model\.layers\.\d+\.block_sparse_moe\.experts)\.(\d+)\.(w[123])\.(weight|weight_packed|weight_scale)$")
_DENSE_ALIAS_RE = re.compile(r"^model\.layers\.(\d+)\.block_sparse_moe\.((?:gate|up|down)_proj\.weight)$")

Shape = tuple[int, ...]


def keeps_fp32(name: str) -> bool:
    """Whether a tensor stays fp32 in checkpoints and models whatever the requested dtype."""
    return name.endswith(_FP32_SUFFIXES)


def storage_dtype(name: str, dtype: torch.dtype) -> torch.dtype:
    if is_packed_buffer(name):
        return torch.uint8
    return torch.float32 if keeps_fp32(name) else dtype


def _kda(cfg: K3Config) -> dict[str, Shape]:
    lac, H = cfg.linear_attn_config, cfg.hidden_size
    nh, d, K = lac.num_heads, lac.head_dim, lac.short_conv_kernel_size
    P = nh * d
    t = {f"{p}_proj.weight": (P, H) for p in "qkv"}
    t.update({f"{p}_conv1d.weight": (P, 1, K) for p in "qkv"})
    t.update({"f_a_proj.weight": (d, H), "f_b_proj.weight": (P, d), "b_proj.weight": (nh, H),
              "A_log": (nh,), "dt_bias": (P,), "o_norm.weight": (d,), "o_proj.weight": (H, P)})
    if lac.use_full_rank_gate:
        t["g_proj.weight"] = (P, H)
    else:
        t.update({"g_a_proj.weight": (d, H), "g_b_proj.weight": (P, d)})
    return t


def _mla(cfg: K3Config) -> dict[str, Shape]:
    H, nh = cfg.hidden_size, cfg.num_attention_heads
    t: dict[str, Shape] = {}
    if cfg.q_lora_rank is None:
        t["q_proj.weight"] = (nh * cfg.qk_head_dim, H)
    else:
        t.update({"q_a_proj.weight": (cfg.q_lora_rank, H), "q_a_layernorm.weight": (cfg.q_lora_rank,),
                  "q_b_proj.weight": (nh * cfg.qk_head_dim, cfg.q_lora_rank)})
    t.update({"kv_a_proj_with_mqa.weight": (cfg.kv_lora_rank + cfg.qk_rope_head_dim, H),
              "kv_a_layernorm.weight": (cfg.kv_lora_rank,),
              "kv_b_proj.weight": (nh * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank),
              "o_proj.weight": (H, nh * cfg.v_head_dim)})
    if cfg.mla_use_output_gate:
        t["g_proj.weight"] = (nh * cfg.v_head_dim, H)
    return t


def _mlp(H: int, inter: int) -> dict[str, Shape]:
    return {"gate_proj.weight": (inter, H), "up_proj.weight": (inter, H), "down_proj.weight": (H, inter)}


def _moe(cfg: K3Config) -> dict[str, Shape]:
    H, E, F, L = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size, cfg.expert_dim
    t: dict[str, Shape] = {"gate.weight": (E, H), "gate.e_score_correction_bias": (E,),
                           "experts.w1": (E, F, L), "experts.w3": (E, F, L), "experts.w2": (E, L, F)}
    if cfg.uses_latent_moe:
        t.update({"routed_expert_down_proj.weight": (L, H), "routed_expert_up_proj.weight": (H, L)})
        if cfg.latent_moe_use_norm:
            t["routed_expert_norm.weight"] = (L,)
    if cfg.num_shared_experts:
        t.update({f"shared_experts.{k}": v
                  for k, v in _mlp(H, cfg.num_shared_experts * cfg.moe_intermediate_size).items()})
    return t


def _pack(shapes: dict[str, Shape]) -> dict[str, Shape]:
    """Stacked float experts ``experts.wN`` [E, out, in] -> their packed MXFP4 buffers."""
    out: dict[str, Shape] = {}
    for name, shape in shapes.items():
        if is_stacked_expert(name):
            E, o, i = shape
            out[name + "_packed"], out[name + "_scale"] = (E, o, i // 2), (E, o, i // MX_BLOCK)
        else:
            out[name] = shape
    return out


def expected_tensors(config: K3Config, dtype: torch.dtype = torch.float32,
                     packed: bool = False) -> dict[str, tuple[Shape, torch.dtype]]:
    """``{internal name: (shape, dtype)}`` of every tensor a K3 state dict holds for ``config``.

    Routed experts are stacked ([E, out, in], nn.Linear layout per expert), or with ``packed``
    held as MXFP4 bytes (``experts.wN_packed`` uint8 [E, out, in/2], ``experts.wN_scale`` uint8
    [E, out, in/32]). ``dtype`` is the model dtype; the tensors the release keeps in fp32 are
    listed as fp32. With tied embeddings ``lm_head.weight`` is not listed (it is
    ``model.embed_tokens.weight``).
    """
    H = config.hidden_size
    shapes: dict[str, Shape] = {"model.embed_tokens.weight": (config.vocab_size, H), "model.norm.weight": (H,)}
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, H)
    res = config.attn_res_block_size is not None
    if res:
        shapes.update({"model.output_attn_res_proj.weight": (1, H), "model.output_attn_res_norm.weight": (H,)})
    for l in range(config.num_hidden_layers):
        p = f"model.layers.{l}."
        shapes[p + "input_layernorm.weight"] = (H,)
        shapes[p + "post_attention_layernorm.weight"] = (H,)
        if res:
            for r in ("self_attention_res", "mlp_res"):
                shapes.update({f"{p}{r}_proj.weight": (1, H), f"{p}{r}_norm.weight": (H,)})
        attn = _kda(config) if config.is_kda_layer(l) else _mla(config)
        shapes.update({f"{p}self_attn.{k}": v for k, v in attn.items()})
        if config.is_moe_layer(l):
            shapes.update({f"{p}block_sparse_moe.{k}": v for k, v in _moe(config).items()})
        else:
            shapes.update({f"{p}mlp.{k}": v for k, v in _mlp(H, config.intermediate_size).items()})
    if packed:
        shapes = _pack(shapes)
    return {n: (s, storage_dtype(n, dtype)) for n, s in shapes.items()}


def is_vision_tensor(name: str) -> bool:
    """A K3 vision tower / projector tensor (``vision_tower.…``, ``mm_projector.…``)."""
    return name.startswith(VISION_PREFIXES)


def expected_vision_tensors(vc: VisionConfig) -> dict[str, Shape]:
    """``{name: shape}`` of every tensor of the MoonViT3d tower + ``patchmergerv2`` projector, under
    the release's names, which are also the names in :class:`K3VLForConditionalGeneration`'s state
    dict (SPEC §3.9; biases only where the vision config asks for them, none in K3). Vision tensors
    are stored as floats (bf16 in the release), never MXFP4."""
    D, Q, I, p = vc.vt_hidden_size, vc.qkv_hidden_size, vc.vt_intermediate_size, vc.patch_size
    M, H = vc.projector_dim, vc.text_hidden_size
    t: dict[str, Shape] = {"vision_tower.patch_embed.proj.weight": (D, 3, p, p),
                           "vision_tower.patch_embed.pos_emb.weight": (vc.init_pos_emb_height,
                                                                       vc.init_pos_emb_width, D)}
    if vc.patch_embed_proj_bias:
        t["vision_tower.patch_embed.proj.bias"] = (D,)
    for n in range(vc.vt_num_hidden_layers):
        b = f"vision_tower.encoder.blocks.{n}."
        t.update({b + "norm0.weight": (D,), b + "wqkv.weight": (3 * Q, D), b + "wo.weight": (D, Q),
                  b + "norm1.weight": (D,), b + "mlp.fc0.weight": (I, D), b + "mlp.fc1.weight": (D, I)})
        if vc.attn_bias:
            t.update({b + "wqkv.bias": (3 * Q,), b + "wo.bias": (D,)})
        if vc.linear_bias:
            t.update({b + "mlp.fc0.bias": (I,), b + "mlp.fc1.bias": (D,)})
    t.update({"vision_tower.encoder.final_layernorm.weight": (D,), "mm_projector.proj.0.weight": (M, M),
              "mm_projector.proj.2.weight": (H, M), "mm_projector.post_norm.weight": (H,)})
    return t


def is_stacked_expert(name: str) -> bool:
    return ".block_sparse_moe.experts.w" in name


def is_packed_buffer(name: str) -> bool:
    """``...experts.wN_packed`` / ``...experts.wN_scale``: an expert matrix held as MXFP4 bytes."""
    return is_stacked_expert(name) and name.endswith(("_packed", "_scale"))


def holds_packed_experts(state_dict_names) -> bool:
    """Whether a k3 state dict holds its routed experts packed (``PackedMXFP4Experts``)."""
    return any(is_packed_buffer(n) for n in state_dict_names)


def stores_packed_experts(file_tensor_names) -> bool:
    """Whether a checkpoint stores routed experts as ``.weight_packed`` / ``.weight_scale``."""
    return any(n.endswith(".weight_packed") and _EXPERT_RE.match(n.removeprefix(TEXT_PREFIX))
               for n in file_tensor_names)


_FILE_SUFFIX = {"": "weight", "_packed": "weight_packed", "_scale": "weight_scale"}


def file_names(name: str, shape: Shape) -> list[tuple[str, int | None]]:
    """The on-disk names k3 writes for one internal tensor: ``[(file name, expert index or None)]``."""
    if not is_stacked_expert(name):
        return [(name, None)]
    base, w = name.rsplit(".", 1)
    w, _, kind = w.partition("_")
    suffix = _FILE_SUFFIX["_" + kind if kind else ""]
    return [(f"{base}.{e}.{w}.{suffix}", e) for e in range(shape[0])]


@dataclass(frozen=True)
class Target:
    """Where one on-disk tensor goes: internal ``name``, expert slot, and how it is stored.

    ``kind``: ``"plain"`` (a float tensor), ``"packed"`` / ``"scale"`` (the two halves of an MXFP4
    expert matrix), or ``"ignored"`` (vision tensors). ``file_shape`` is the shape it must have.
    """

    name: str
    kind: str
    expert: int | None = None
    file_shape: Shape | None = None


def _accepts_a_log(shape: Shape, nh: int) -> bool:
    # [nh] (k3), [1,1,nh,1] (Kimi-Linear), or 1-D padded beyond nh (the K3 release pads to 128).
    return (len(shape) == 1 and shape[0] >= nh) or shape == (1, 1, nh, 1)


def not_text(file_name: str, multimodal: bool) -> bool:
    """Whether an on-disk tensor is not part of the text model (a text load ignores it; a
    multimodal load reads the K3 vision tensors among these): in a ``multimodal`` checkpoint
    everything without the ``language_model.`` prefix, elsewhere the known vision prefixes."""
    if file_name.startswith(TEXT_PREFIX):
        return False
    return multimodal or file_name.startswith(_VISION_PREFIXES)


def resolve(file_name: str, config: K3Config, expected: dict[str, tuple[Shape, torch.dtype]],
            multimodal: bool) -> Target | None:
    """Map an on-disk tensor name to its :class:`Target`, or None when k3 has no such tensor.

    ``multimodal``: the checkpoint prefixes text tensors with ``language_model.``; anything
    without the prefix is then a vision/projector tensor and ignored.
    """
    if not_text(file_name, multimodal):
        return Target(file_name, "ignored")
    name = file_name.removeprefix(TEXT_PREFIX)
    m = _EXPERT_RE.match(name)
    if m:
        internal = f"{m.group(1)}.{m.group(3)}"
        kind = {"weight": "plain", "weight_packed": "packed", "weight_scale": "scale"}[m.group(4)]
        e = int(m.group(2))
        if kind != "plain" and f"{internal}_{kind}" in expected:  # packed model: bytes kept as stored
            internal = f"{internal}_{kind}"
            shape = expected[internal][0]
            return Target(internal, kind, e, shape[1:]) if e < shape[0] else None
        if internal not in expected:
            return None
        E, out, inp = expected[internal][0]
        if e >= E:
            return None
        shape = {"plain": (out, inp), "packed": (out, inp // 2), "scale": (out, inp // MX_BLOCK)}[kind]
        return Target(internal, kind, e, shape)
    m = _DENSE_ALIAS_RE.match(name)
    if m and name not in expected:
        alias = f"model.layers.{m.group(1)}.mlp.{m.group(2)}"
        if alias in expected:
            name = alias
    if name not in expected:
        return None
    shape = expected[name][0]
    if name.endswith(".A_log"):
        return Target(name, "plain", None, None)  # shape checked by check_file_shape
    return Target(name, "plain", None, shape)


def check_file_shape(target: Target, shape: Shape, config: K3Config) -> str | None:
    """None if ``shape`` is acceptable on disk for ``target``, else the expected shape as text."""
    if target.file_shape is None:  # A_log
        nh = config.linear_attn_config.num_heads
        return None if _accepts_a_log(shape, nh) else f"[{nh}] (or [1, 1, {nh}, 1], or 1-D padded beyond {nh})"
    return None if tuple(shape) == tuple(target.file_shape) else str(list(target.file_shape))


def to_internal(target: Target, t: torch.Tensor, config: K3Config) -> torch.Tensor:
    """Reshape a plain on-disk tensor to its internal shape (only ``A_log`` differs)."""
    if target.name.endswith(".A_log"):
        return t.reshape(-1)[: config.linear_attn_config.num_heads]
    return t


# --------------------------------------------------------------------------- quantization_config
MXFP4_FORMAT = "mxfp4-pack-quantized"
QUANT_CONFIG_KEY = "quantization_config"

# compressed-tensors decides per module: quantized when a config group's ``targets`` match it (a
# class name such as "Linear", an exact module name, or "re:<regex>" applied with re.match) and no
# ``ignore`` entry matches it. As in Moonshot's released configs the group targets every Linear and
# the ignore list removes everything that is not a routed expert; the patterns start with ".*" so
# they also hold under the multimodal ``language_model.`` prefix. (Embeddings and norms are not
# Linear modules and need no entry.)
MXFP4_IGNORE = [
    "re:.*lm_head$",
    r"re:.*\.self_attn\..*",  # KDA and MLA: every projection
    r"re:.*\.shared_experts\..*",
    r"re:.*\.mlp\.(gate|up|down)_proj$",  # dense MLP (layers < first_k_dense_replace)
    r"re:.*\.block_sparse_moe\.gate$",  # router
    r"re:.*\.routed_expert_(down|up)_proj$",  # latent projections
    r"re:.*_res_proj$",  # AttnRes pseudo-queries (self_attention_res, mlp_res, output_attn_res)
]
# a multimodal checkpoint also keeps its vision tower and projector in bf16 (the release's entries)
MXFP4_VISION_IGNORE = ["re:.*vision_tower.*", "re:.*mm_projector.*"]


# compressed-tensors' group-32 float8 scheme: MXFP8 (E4M3 elements, one E8M0 scale per 32 along the
# feature dim), computed at run time from each matmul input (dynamic).
MXFP8_INPUT_ACTIVATIONS = {"num_bits": 8, "type": "float", "symmetric": True, "group_size": MX_BLOCK,
                           "strategy": "group", "block_structure": None, "dynamic": True, "actorder": None,
                           "observer": None, "observer_kwargs": {}, "scale_dtype": "torch.uint8",
                           "zp_dtype": "torch.uint8"}
_MXFP8_KEYS = {"num_bits": 8, "type": "float", "strategy": "group", "group_size": MX_BLOCK}


def mxfp4_quantization_config(act_fmt: str | None = None, multimodal: bool = False) -> dict:
    """The compressed-tensors ``quantization_config`` of a checkpoint whose routed experts are
    packed MXFP4: FP4 E2M1 weights ("float", 4 bits), one E8M0 (uint8) scale per group of 32
    along the input dimension, symmetric, static. ``input_activations``: null for ``act_fmt``
    None (weight-only, as the release declares: activations stay in the compute dtype), the
    MXFP8 group-32 float8 scheme for ``act_fmt`` "fp8_e4m3" (a model trained with MXFP8
    activation QAT, SPEC §3.7). Loaders apply exactly what is declared (``declared_act_fmt``).
    ``scale_dtype`` / ``zp_dtype`` are written as compressed-tensors' MXFP4 preset writes them
    (there is no zero point: the scheme is symmetric). ``multimodal``: the ignore list also names
    the vision tower and projector (:data:`MXFP4_VISION_IGNORE`).
    """
    if act_fmt not in (None, ACT_FMT):
        raise ValueError(f"act_fmt must be None or {ACT_FMT!r}, got {act_fmt!r}")
    weights = {"num_bits": 4, "type": "float", "symmetric": True, "group_size": MX_BLOCK, "strategy": "group",
               "block_structure": None, "dynamic": False, "actorder": None, "observer": "minmax",
               "observer_kwargs": {}, "scale_dtype": "torch.uint8", "zp_dtype": "torch.uint8"}
    acts = dict(MXFP8_INPUT_ACTIVATIONS) if act_fmt else None
    return {
        "quant_method": "compressed-tensors",
        "format": MXFP4_FORMAT,
        "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": acts,
                                      "output_activations": None, "format": MXFP4_FORMAT}},
        "ignore": list(MXFP4_IGNORE) + (list(MXFP4_VISION_IGNORE) if multimodal else []),
        "kv_cache_scheme": None,
    }


def declared_act_fmt(qc: object, where: str) -> str | None:
    """The expert activation format a ``quantization_config`` declares: None (no config, or
    ``input_activations`` null) or "fp8_e4m3" (the MXFP8 group-32 float8 scheme). Anything else,
    including a non-MXFP4 quantization, is refused naming the field (``where``: the config path)."""
    if qc is None:
        return None
    if not is_mxfp4_quantization(qc):
        raise CheckpointError(f"{where}: quantization_config {_short(qc)} is not compressed-tensors "
                              f"{MXFP4_FORMAT}, the only quantization k3 loads")
    fmts = set()
    for gname, g in (qc.get("config_groups") or {}).items():
        field = f"{where}: quantization_config.config_groups.{gname}"
        if not isinstance(g, dict):
            raise CheckpointError(f"{field}: expected an object, got {_short(g)}")
        if g.get("output_activations") is not None:
            raise CheckpointError(f"{field}.output_activations: k3 does not quantize outputs, got "
                                  f"{_short(g['output_activations'])}")
        acts = g.get("input_activations")
        if acts is None:
            fmts.add(None)
        elif isinstance(acts, dict) and all(acts.get(k) == v for k, v in _MXFP8_KEYS.items()):
            fmts.add(ACT_FMT)
        else:
            raise CheckpointError(f"{field}.input_activations: only null (weights-only) or MXFP8 "
                                  f"{_MXFP8_KEYS} are supported, got {_short(acts)}")
    if len(fmts) > 1:
        raise CheckpointError(f"{where}: quantization_config groups declare different input_activations")
    return fmts.pop() if fmts else None


def _short(v: object) -> str:
    text = repr(v)
    return text if len(text) <= 120 else text[:117] + "..."


def is_mxfp4_quantization(qc: object) -> bool:
    """Whether a ``quantization_config`` declares compressed-tensors ``mxfp4-pack-quantized``."""
    if not isinstance(qc, dict) or qc.get("quant_method") != "compressed-tensors":
        return False
    groups = qc.get("config_groups") or {}
    return qc.get("format") == MXFP4_FORMAT or any(
        isinstance(g, dict) and g.get("format") == MXFP4_FORMAT for g in groups.values())
