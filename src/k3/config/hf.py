"""The ``config.json`` formats k3 reads and writes, mapped onto the fields of
:class:`k3.config.model.K3Config` (SPEC §2, §4).

Three shapes are accepted:

* **flat** (Moonshot's Kimi-Linear / K3 text config, and what k3 writes): schema field names plus a
  ``linear_attn_config`` dict with 1-indexed ``kda_layers`` / ``full_attn_layers``;
* **transformers** (``KimiLinearConfig.save_pretrained``): ``layer_types`` (``linear_attention`` /
  ``full_attention`` per layer), ``mlp_layer_types`` (``dense`` / ``sparse``), ``linear_num_heads``,
  ``linear_head_dim``, ``linear_conv_kernel_dim``, ``model_max_length`` and the attribute-map
  aliases (``num_experts_per_tok``, ``n_shared_experts``, ``num_local_experts``, ``norm_topk_prob``,
  ``n_group``);
* **kimi_k3 wrapper** (multimodal release): ``text_config`` (one of the above) + ``vision_config``
  + wrapper keys, kept verbatim.

A ``kimi_linear`` config holding none of K3's own fields is a Kimi-Linear model and gets
Kimi-Linear's values for them (:data:`KIMI_LINEAR_DEFAULTS`). Keys the schema does not know
(``architectures``, ``torch_dtype``, ``auto_map``, ``use_cache``, ...) are kept in ``extra`` and
written back unchanged. The transformers-form views of schema fields (``layer_types``,
``mlp_layer_types``, ``linear_*``, the aliases, ``num_key_value_heads``, ``qk_head_dim``) are checked
against the fields and dropped, so a ``replace`` can never leave a stale copy behind (transformers
reads the flat form k3 writes). HF keys that would change the model (``attention_bias``,
``attention_dropout``, ``moe_layer_freq``, ``topk_method``, ``use_grouped_topk``) are accepted
only at the value k3 implements; ``rope_theta`` / ``rope_scaling`` pass through (MLA is NoPE). Every problem is a
:class:`~k3.errors.ConfigError` naming the key.

This module works on dicts and on a config's attributes; ``K3Config.from_dict`` / ``from_json`` /
``to_dict`` (:mod:`k3.config.model`) call it, so it never imports the class.
"""

from __future__ import annotations

import copy
import json
import os
from typing import Any, Iterable

from k3.config.checks import check_int
from k3.errors import ConfigError

__all__ = ["split_wrapper", "read_json", "text_kwargs", "check_hf_keys", "config_to_dict", "wrap_text_config",
           "kimi_linear_defaults", "linear_attn_from_layer_types", "KIMI_LINEAR_DEFAULTS", "HF_ALIASES",
           "DEFAULT_WRAPPER", "WRAPPER_KEYS"]

WRAPPER_KEYS = ("text_config", "vision_config")
DEFAULT_WRAPPER = {"model_type": "kimi_k3", "architectures": ["KimiK3ForConditionalGeneration"]}
# transformers' KimiLinearConfig.attribute_map (alias -> schema field)
HF_ALIASES = {"num_experts_per_tok": "num_experts_per_token", "n_shared_experts": "num_shared_experts",
              "num_local_experts": "num_experts", "norm_topk_prob": "moe_renormalize",
              "n_group": "num_expert_group", "model_max_length": "max_position_embeddings"}
# Fields that exist only in K3. A kimi_linear config holding none of them is a Kimi-Linear model,
# whose values for them differ from K3Config's (K3) defaults.
KIMI_LINEAR_DEFAULTS = {"routed_expert_hidden_size": None, "latent_moe_use_norm": False,
                        "mla_use_output_gate": False, "attn_res_block_size": None,
                        "activation_situ_linear_beta": None, "hidden_act": "silu"}
_KIMI_LINEAR_LAC = {"gate_lower_bound": None, "use_full_rank_gate": False}
_LAYER_TYPES = ("linear_attention", "full_attention")
_MLP_TYPES = ("dense", "sparse")
_TRANSFORMERS_LINEAR = {"linear_num_heads": ("num_heads", 32), "linear_head_dim": ("head_dim", 128),
                        "linear_conv_kernel_dim": ("short_conv_kernel_size", 4)}


# ------------------------------------------------------------------------------ reading
def split_wrapper(d: Any) -> tuple[dict[str, Any], dict[str, Any] | None, dict[str, Any] | None]:
    """A config.json dict -> (text config dict, vision_config or None, wrapper keys or None: a flat
    text config has no wrapper)."""
    if not isinstance(d, dict):
        raise ConfigError(f"a config must be a JSON object, got {type(d).__name__}")
    if "text_config" not in d:
        return d, None, None
    text = d["text_config"]
    if not isinstance(text, dict):
        raise ConfigError(f"text_config must be a JSON object, got {type(text).__name__}")
    vision = d.get("vision_config")
    if vision is not None and not isinstance(vision, dict):
        raise ConfigError(f"vision_config must be a JSON object or null, got {type(vision).__name__}")
    wrapper = {k: copy.deepcopy(v) for k, v in d.items() if k not in WRAPPER_KEYS}
    return text, copy.deepcopy(vision), wrapper


def read_json(path_or_text: str | os.PathLike) -> tuple[Any, str]:
    """(the parsed JSON, where it came from) of a config.json path, a checkpoint directory (its
    config.json) or a JSON string."""
    src = os.fspath(path_or_text)
    if os.path.isdir(src):
        src = os.path.join(src, "config.json")
    if os.path.exists(src):
        try:
            with open(src, encoding="utf-8") as f:
                return json.load(f), src
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ConfigError(f"{src}: not valid JSON ({e})") from None
    try:
        return json.loads(src), "config JSON"
    except json.JSONDecodeError:
        raise FileNotFoundError(f"no config file at {src!r} (and it is not a JSON string)") from None


def text_kwargs(d: dict[str, Any], names: Iterable[str]) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """A text config dict (any of the shapes above) -> (schema fields ``names`` as keyword arguments,
    the passed-through ``extra`` keys, the transformers views to check once the config is built:
    ``check_hf_keys``)."""
    d = copy.deepcopy(d)
    _apply_aliases(d)
    d = kimi_linear_defaults(d)
    if "layer_types" in d:
        from_types = linear_attn_from_layer_types(d)
        if "linear_attn_config" not in d:
            d["linear_attn_config"] = from_types
            d.setdefault("mla_latent_norm_eps", 1e-6)  # transformers' Kimi-Linear MLA latent norms
        else:
            _check_layer_types_agree(d["linear_attn_config"], from_types, d)
        for key in ("layer_types", "mlp_layer_types", *_TRANSFORMERS_LINEAR):
            d.pop(key, None)
    if d.get("model_type") == "kimi_linear" and "mla_latent_norm_eps" not in d:
        # Moonshot's Kimi-Linear code and transformers use 1e-6 for the MLA latent norms;
        # configs written by k3 always carry the field explicitly.
        d["mla_latent_norm_eps"] = 1e-6
    names = set(names)
    kw = {k: d.pop(k) for k in list(d) if k in names}
    for tid in ("eos_token_id", "bos_token_id", "pad_token_id"):
        v = kw.get(tid)
        if isinstance(v, list):  # HF allows a list of ids; keep the first, preserve all
            if not v:
                raise ConfigError(f"{tid} is an empty list")
            for i in v:
                check_int(f"{tid} entry", i, lo=0)
            d[f"{tid}s"] = v
            kw[tid] = v[0]
    views = {k: d.pop(k) for k in ("num_key_value_heads", "qk_head_dim") if k in d}
    return kw, d, views


def _apply_aliases(d: dict[str, Any]) -> None:
    """Schema fields from transformers' aliases (both present must agree); the alias is dropped."""
    for alias, name in HF_ALIASES.items():
        if alias not in d or (alias == "model_max_length" and name in d):
            continue  # Moonshot's model_max_length beside max_position_embeddings is its own key
        v = d.pop(alias)
        if name not in d:
            d[name] = v
        elif d[name] != v:
            raise ConfigError(f"{alias}={v!r} disagrees with {name}={d[name]!r}")


def kimi_linear_defaults(d: dict[str, Any]) -> dict[str, Any]:
    """Kimi-Linear's values for K3's own fields, when a kimi_linear config holds none of them."""
    if d.get("model_type") != "kimi_linear" or any(k in d for k in KIMI_LINEAR_DEFAULTS if k != "hidden_act"):
        return d
    for k, v in KIMI_LINEAR_DEFAULTS.items():
        d.setdefault(k, v)
    if isinstance(d.get("linear_attn_config"), dict):
        d["linear_attn_config"] = {**_KIMI_LINEAR_LAC, **d["linear_attn_config"]}
    return d


def linear_attn_from_layer_types(d: dict[str, Any]) -> dict[str, Any]:
    """``linear_attn_config`` from transformers' ``layer_types`` / ``linear_*`` fields.

    Also sets ``first_k_dense_replace`` from ``mlp_layer_types`` (dense layers must be a prefix).
    """
    types = d["layer_types"]
    if not isinstance(types, list) or any(t not in _LAYER_TYPES for t in types):
        raise ConfigError(f"layer_types must be a list of {list(_LAYER_TYPES)}, got {types!r}")
    n = d.get("num_hidden_layers", len(types))
    if len(types) != n:
        raise ConfigError(f"layer_types has {len(types)} entries but num_hidden_layers={n!r}")
    mlp_types = d.get("mlp_layer_types")
    if mlp_types is not None:
        if not isinstance(mlp_types, list) or any(t not in _MLP_TYPES for t in mlp_types) \
                or len(mlp_types) != len(types):
            raise ConfigError(f"mlp_layer_types must be a list of {len(types)} entries from "
                              f"{list(_MLP_TYPES)}, got {mlp_types!r}")
        dense = [i for i, t in enumerate(mlp_types) if t == "dense"]
        if dense != list(range(len(dense))):
            raise ConfigError("mlp_layer_types: dense layers must be a prefix of the stack")
        if d.setdefault("first_k_dense_replace", len(dense)) != len(dense):
            raise ConfigError(f"mlp_layer_types has {len(dense)} dense layers but "
                              f"first_k_dense_replace={d['first_k_dense_replace']!r}")
    lac = {key: d.get(hf, default) for hf, (key, default) in _TRANSFORMERS_LINEAR.items()}
    return {"kda_layers": [i + 1 for i, t in enumerate(types) if t == "linear_attention"],
            "full_attn_layers": [i + 1 for i, t in enumerate(types) if t == "full_attention"],
            **lac, **_KIMI_LINEAR_LAC}


def _check_layer_types_agree(lac: Any, from_types: dict[str, Any], d: dict[str, Any]) -> None:
    """A config holding both forms (transformers re-saving a Moonshot config) must say one thing."""
    if not isinstance(lac, dict):
        raise ConfigError(f"linear_attn_config must be a JSON object, got {lac!r}")
    for key in ("kda_layers", "full_attn_layers"):
        if key in lac and isinstance(lac[key], list) and sorted(map(str, lac[key])) != \
                sorted(map(str, from_types[key])):
            raise ConfigError(f"layer_types disagrees with linear_attn_config.{key}")
    for hf, (key, _) in _TRANSFORMERS_LINEAR.items():
        if hf in d and key in lac and d[hf] != lac[key]:
            raise ConfigError(f"{hf}={d[hf]!r} disagrees with linear_attn_config.{key}={lac[key]!r}")


def check_hf_keys(cfg, views: dict[str, Any]) -> None:
    """HF keys that would change the model are accepted only at the value k3 implements (``cfg``: the
    built config, whose ``extra`` holds them; ``views``: from ``text_kwargs``)."""
    x = cfg.extra
    if x.get("attention_bias", False) is not False:
        raise ConfigError(f"attention_bias={x['attention_bias']!r}: attention projections with a bias "
                          "are not implemented (use false)")
    drop = x.get("attention_dropout", 0.0)
    if drop is not None and (isinstance(drop, bool) or drop != 0):
        raise ConfigError(f"attention_dropout={drop!r}: attention dropout is not implemented (use 0.0)")
    if x.get("moe_layer_freq", 1) != 1:
        raise ConfigError(f"moe_layer_freq={x['moe_layer_freq']!r}: k3 puts MoE in every layer from "
                          "first_k_dense_replace on (use 1)")
    if x.get("topk_method", "noaux_tc") != "noaux_tc":
        raise ConfigError(f"topk_method={x['topk_method']!r}: k3 routes by top-k with a selection-only "
                          "bias ('noaux_tc')")
    if x.get("use_grouped_topk", True) is not True and cfg.num_expert_group > 1:
        raise ConfigError("use_grouped_topk=false with num_expert_group > 1: k3 always applies "
                          "group-limited routing when there are groups")
    kv = views.get("num_key_value_heads")
    if kv is not None and kv != cfg.num_attention_heads:
        raise ConfigError(f"num_key_value_heads={kv!r} differs from num_attention_heads="
                          f"{cfg.num_attention_heads}: MLA has one key/value head per query head")
    qk = views.get("qk_head_dim")
    if qk is not None and qk != cfg.qk_head_dim:
        raise ConfigError(f"qk_head_dim={qk!r} differs from qk_nope_head_dim + qk_rope_head_dim = "
                          f"{cfg.qk_head_dim}")


# ------------------------------------------------------------------------------ writing
def config_to_dict(cfg) -> dict[str, Any]:
    """The config.json dict: flat text config, or the kimi_k3 wrapper when ``cfg`` came from one."""
    text = cfg.to_text_dict()
    if cfg.wrapper is None and cfg.vision_config is None:
        return text
    return wrap_text_config(cfg, text)


def wrap_text_config(cfg, text: dict[str, Any]) -> dict[str, Any]:
    """The kimi_k3 wrapper around the text config dict ``text``: ``cfg``'s wrapper keys (the
    release's model_type / architectures when it has none), ``text_config`` and its ``vision_config``."""
    out = copy.deepcopy(cfg.wrapper or DEFAULT_WRAPPER)
    out["text_config"] = text
    if cfg.vision_config is not None:
        out["vision_config"] = copy.deepcopy(cfg.vision_config)
    return out
