"""The text model's configuration: one dataclass whose fields are the HF ``kimi_linear`` names,
and its validation (SPEC §2).

Its neighbours in :mod:`k3.config`: :mod:`k3.config.hf` maps the ``config.json`` shapes (Moonshot's
flat ``linear_attn_config`` form, transformers' ``layer_types`` form, the ``kimi_k3`` wrapper) onto
the fields here (``from_dict`` / ``from_json`` / ``to_dict``); :mod:`k3.config.presets` holds the
named configurations; :mod:`k3.config.checks` the value checks.

Every field is either read by the model / checkpoint code or refused: a value the model does not
implement (``mla_use_nope=False``, ``num_nextn_predict_layers > 0``) raises :class:`ConfigError`
naming the field. Some fields are read only under another one (the SiTU betas under
``hidden_act='situ'``, ``latent_moe_use_norm`` with a latent width, MoE sizes with experts).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import os
from dataclasses import dataclass, field
from typing import Any

from k3.config.checks import (MAX_LAYERS, check_bool, check_choice, check_dict, check_float, check_int,
                              refuse_unknown)
from k3.config.hf import check_hf_keys, config_to_dict, read_json, split_wrapper, text_kwargs
from k3.errors import ConfigError

__all__ = ["LinearAttnConfig", "K3Config", "k3_layer_split"]

log = logging.getLogger("k3.config")

# ------------------------------------------------------------------------------ schema
@dataclass
class LinearAttnConfig:
    """The ``linear_attn_config`` sub-dict: KDA geometry and the 1-indexed layer split."""

    kda_layers: list[int] = field(default_factory=list)
    full_attn_layers: list[int] = field(default_factory=list)
    num_heads: int = 96
    head_dim: int = 128
    short_conv_kernel_size: int = 4
    gate_lower_bound: float | None = -5.0
    use_full_rank_gate: bool = True
    extra: dict[str, Any] = field(default_factory=dict)

    _KNOWN = ("kda_layers", "full_attn_layers", "num_heads", "head_dim", "short_conv_kernel_size",
              "gate_lower_bound", "use_full_rank_gate")

    @classmethod
    def from_dict(cls, d: Any) -> "LinearAttnConfig":
        if not isinstance(d, dict):
            raise ConfigError(f"linear_attn_config must be a JSON object, got {d!r}")
        kw = {k: copy.deepcopy(d[k]) for k in cls._KNOWN if k in d}
        return cls(**kw, extra={k: copy.deepcopy(v) for k, v in d.items() if k not in cls._KNOWN})

    def to_dict(self) -> dict[str, Any]:
        d = {k: copy.deepcopy(getattr(self, k)) for k in self._KNOWN}
        d.update(copy.deepcopy(self.extra))
        return d

    def validate(self) -> None:
        for name in ("num_heads", "head_dim", "short_conv_kernel_size"):
            check_int(f"linear_attn_config.{name}", getattr(self, name), lo=1)
        check_float("linear_attn_config.gate_lower_bound", self.gate_lower_bound, allow_none=True)
        if self.gate_lower_bound is not None and not self.gate_lower_bound < 0:
            raise ConfigError(f"linear_attn_config.gate_lower_bound must be < 0 or null, "
                              f"got {self.gate_lower_bound}")
        check_bool("linear_attn_config.use_full_rank_gate", self.use_full_rank_gate)
        for name in ("kda_layers", "full_attn_layers"):
            layers = getattr(self, name)
            if not isinstance(layers, list):
                raise ConfigError(f"linear_attn_config.{name} must be a list of layer ids, got {layers!r}")
            for i in layers:
                check_int(f"linear_attn_config.{name} entry", i)
        check_dict("linear_attn_config.extra", self.extra, allow_none=False)


def k3_layer_split(num_layers: int, period: int = 4) -> tuple[list[int], list[int]]:
    """1-indexed (kda, full) lists: full attention every ``period``-th layer and at the last."""
    full = [i for i in range(1, num_layers + 1) if i % period == 0 or i == num_layers]
    kda = [i for i in range(1, num_layers + 1) if i not in full]
    return kda, full


_NOT_TEXT = ("vision_config", "wrapper", "extra")


@dataclass
class K3Config:
    """Text-model configuration (HF field names). See SPEC §2 for the meaning of each field."""

    vocab_size: int = 163840
    hidden_size: int = 7168
    num_hidden_layers: int = 93
    linear_attn_config: LinearAttnConfig = field(default_factory=LinearAttnConfig)
    # Gated MLA
    num_attention_heads: int = 96
    q_lora_rank: int | None = 1536
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    mla_use_nope: bool = True   # the model implements NoPE MLA only: False is refused
    mla_use_output_gate: bool = True
    mla_latent_norm_eps: float | None = None  # None -> rms_norm_eps (K3); Kimi-Linear uses 1e-6
    # MLP / MoE
    intermediate_size: int = 33792
    first_k_dense_replace: int = 1
    num_experts: int = 896
    num_experts_per_token: int = 16
    num_shared_experts: int = 2
    moe_intermediate_size: int = 3072
    routed_expert_hidden_size: int | None = 3584
    latent_moe_use_norm: bool = True
    moe_router_activation_func: str = "sigmoid"
    moe_renormalize: bool = True
    routed_scaling_factor: float = 1.0
    num_expert_group: int = 1
    topk_group: int = 1
    # activation
    hidden_act: str = "situ"
    activation_situ_beta: float = 4.0
    activation_situ_linear_beta: float | None = 25.0
    # residuals, norms, positions
    attn_res_block_size: int | None = 12
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 1048576
    tie_word_embeddings: bool = False
    num_nextn_predict_layers: int = 0  # multi-token prediction is not implemented: > 0 is refused
    initializer_range: float = 0.02
    bos_token_id: int | None = 163584  # token ids: tokenizer metadata, kept for HF / generation
    eos_token_id: int | None = 163585
    pad_token_id: int | None = 163839
    # "kimi_k3_text" for K3-architecture configs; "kimi_linear" only for models transformers'
    # KimiLinearForCausalLM can run (no K3-only feature, see k3_only_features); it also selects the
    # Kimi-Linear defaults when a config.json is parsed.
    model_type: str = "kimi_k3_text"
    # multimodal wrapper (kept verbatim until vision lands)
    vision_config: dict[str, Any] | None = None
    wrapper: dict[str, Any] | None = None  # non-text keys of a kimi_k3 wrapper config
    extra: dict[str, Any] = field(default_factory=dict)  # unknown config.json keys, passed through

    def __post_init__(self) -> None:
        if isinstance(self.linear_attn_config, dict):
            self.linear_attn_config = LinearAttnConfig.from_dict(self.linear_attn_config)
        if not isinstance(self.linear_attn_config, LinearAttnConfig):
            raise ConfigError(f"linear_attn_config must be a JSON object, got {self.linear_attn_config!r}")
        lac = self.linear_attn_config
        if not lac.kda_layers and not lac.full_attn_layers and _is_int(self.num_hidden_layers) \
                and 0 < self.num_hidden_layers <= MAX_LAYERS:
            lac.kda_layers, lac.full_attn_layers = k3_layer_split(self.num_hidden_layers)
        self.validate()

    @classmethod
    def text_field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls) if f.name not in _NOT_TEXT]

    # ------------------------------------------------------------------ derived
    @property
    def kda_layer_ids(self) -> list[int]:
        """0-indexed KDA layers."""
        return sorted(i - 1 for i in self.linear_attn_config.kda_layers)

    @property
    def mla_layer_ids(self) -> list[int]:
        """0-indexed Gated MLA (full attention) layers."""
        return sorted(i - 1 for i in self.linear_attn_config.full_attn_layers)

    def is_kda_layer(self, layer: int) -> bool:
        return (layer + 1) in set(self.linear_attn_config.kda_layers)

    def is_moe_layer(self, layer: int) -> bool:
        return layer >= self.first_k_dense_replace and self.num_experts > 0

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_norm_eps(self) -> float:
        return self.rms_norm_eps if self.mla_latent_norm_eps is None else self.mla_latent_norm_eps

    @property
    def uses_latent_moe(self) -> bool:
        return self.routed_expert_hidden_size is not None

    @property
    def expert_dim(self) -> int:
        """Width the routed experts read and write: the latent ℓ, or the hidden size in plain MoE."""
        return self.routed_expert_hidden_size or self.hidden_size

    # --------------------------------------------------------------- validation
    def validate(self) -> None:
        """Check every field's type and range; refuse values the model does not implement."""
        check_int("num_hidden_layers", self.num_hidden_layers, lo=1, hi=MAX_LAYERS)
        for name in ("vocab_size", "hidden_size", "num_attention_heads",
                     "kv_lora_rank", "qk_nope_head_dim", "v_head_dim", "intermediate_size",
                     "max_position_embeddings", "num_expert_group", "topk_group"):
            check_int(name, getattr(self, name), lo=1)
        for name in ("q_lora_rank", "routed_expert_hidden_size", "attn_res_block_size"):
            check_int(name, getattr(self, name), lo=1, allow_none=True)
        for name in ("qk_rope_head_dim", "num_experts", "num_shared_experts", "first_k_dense_replace",
                     "num_nextn_predict_layers", "moe_intermediate_size", "num_experts_per_token"):
            check_int(name, getattr(self, name), lo=0)
        for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
            check_int(name, getattr(self, name), lo=0, allow_none=True)
        for name in ("mla_use_nope", "mla_use_output_gate", "latent_moe_use_norm", "moe_renormalize",
                     "tie_word_embeddings"):
            check_bool(name, getattr(self, name))
        for name in ("rms_norm_eps", "initializer_range", "routed_scaling_factor", "activation_situ_beta"):
            check_float(name, getattr(self, name), lo=0.0, lo_open=True)
        for name in ("mla_latent_norm_eps", "activation_situ_linear_beta"):
            check_float(name, getattr(self, name), lo=0.0, lo_open=True, allow_none=True)
        check_choice("hidden_act", self.hidden_act, ("situ", "silu"))
        check_choice("moe_router_activation_func", self.moe_router_activation_func, ("sigmoid", "softmax"))
        if not isinstance(self.model_type, str):
            raise ConfigError(f"model_type must be a string, got {self.model_type!r}")
        check_dict("vision_config", self.vision_config)
        check_dict("wrapper", self.wrapper)
        check_dict("extra", self.extra, allow_none=False)
        self._refuse_unimplemented()
        self._validate_moe()
        self._validate_layers()

    def k3_only_features(self) -> list[str]:
        """The fields (at their values here) that transformers' Kimi-Linear model does not implement."""
        lac = self.linear_attn_config
        found = {
            "routed_expert_hidden_size": self.routed_expert_hidden_size is not None,
            "latent_moe_use_norm": self.latent_moe_use_norm and self.routed_expert_hidden_size is not None,
            "attn_res_block_size": self.attn_res_block_size is not None,
            "mla_use_output_gate": self.mla_use_output_gate,
            "hidden_act": self.hidden_act != "silu",
            "linear_attn_config.use_full_rank_gate": lac.use_full_rank_gate,
            "linear_attn_config.gate_lower_bound": lac.gate_lower_bound is not None,
        }
        return [name for name, on in found.items() if on]

    def _refuse_unimplemented(self) -> None:
        if self.model_type == "kimi_linear" and self.wrapper is None and self.k3_only_features():
            raise ConfigError(f"model_type='kimi_linear' names transformers' Kimi-Linear model, which does "
                              f"not implement {', '.join(self.k3_only_features())}: use model_type="
                              "'kimi_k3_text' for a K3-architecture config")
        if self.mla_use_nope is not True:
            raise ConfigError("mla_use_nope=false (rotary positions in MLA) is not implemented: "
                              "k3's Gated MLA is NoPE only (SPEC §3.2)")
        if self.num_nextn_predict_layers != 0:
            raise ConfigError(f"num_nextn_predict_layers={self.num_nextn_predict_layers}: multi-token "
                              "prediction layers are not implemented (use 0)")

    def _validate_moe(self) -> None:
        if self.num_experts == 0:
            return
        for name in ("moe_intermediate_size", "num_experts_per_token"):
            check_int(name, getattr(self, name), lo=1)
        if self.num_experts_per_token > self.num_experts:
            raise ConfigError(f"num_experts_per_token ({self.num_experts_per_token}) exceeds "
                              f"num_experts ({self.num_experts})")
        if self.num_experts % self.num_expert_group:
            raise ConfigError(f"num_experts ({self.num_experts}) must be divisible by "
                              f"num_expert_group ({self.num_expert_group})")
        if self.topk_group > self.num_expert_group:
            raise ConfigError(f"topk_group ({self.topk_group}) must be <= num_expert_group "
                              f"({self.num_expert_group})")
        reachable = self.topk_group * (self.num_experts // self.num_expert_group)
        if self.num_experts_per_token > reachable:
            raise ConfigError(f"num_experts_per_token ({self.num_experts_per_token}) exceeds the "
                              f"{reachable} experts reachable with topk_group={self.topk_group}")

    def _validate_layers(self) -> None:
        lac = self.linear_attn_config
        lac.validate()
        n = self.num_hidden_layers
        seen: dict[int, str] = {}
        for kind, layers in (("KDA", lac.kda_layers), ("MLA", lac.full_attn_layers)):
            for i in layers:
                if not 1 <= i <= n:
                    raise ConfigError(f"{kind} layer {i} is out of range: linear_attn_config layer ids "
                                      f"are 1-indexed and num_hidden_layers={n}")
                if i in seen:
                    if seen[i] == kind:
                        raise ConfigError(f"linear_attn_config: layer {i} listed twice as {kind}")
                    raise ConfigError(f"linear_attn_config: layer {i} listed as both KDA and MLA")
                seen[i] = kind
        if len(seen) < n:
            missing = [i for i in range(1, n + 1) if i not in seen]
            raise ConfigError(f"layers {missing[:16]}{'...' if len(missing) > 16 else ''} (1-indexed) "
                              "are neither KDA nor MLA in linear_attn_config")

    # -------------------------------------------------------------- serialising
    def to_text_dict(self) -> dict[str, Any]:
        """The flat text config: every schema field, then the passed-through ``extra`` keys."""
        d: dict[str, Any] = {}
        for name in self.text_field_names():
            v = getattr(self, name)
            d[name] = v.to_dict() if isinstance(v, LinearAttnConfig) else copy.deepcopy(v)
        d.update(copy.deepcopy(self.extra))
        return d

    def to_dict(self) -> dict[str, Any]:
        """The config.json dict: the kimi_k3 wrapper when this config came from one."""
        return config_to_dict(self)

    def to_json(self, path: str | os.PathLike | None = None) -> str:
        s = json.dumps(self.to_dict(), indent=2, sort_keys=False) + "\n"
        if path is not None:
            with open(path, "w") as f:
                f.write(s)
        return s

    @classmethod
    def from_dict(cls, d: Any) -> "K3Config":
        """A flat, transformers-form or kimi_k3-wrapper config.json dict -> validated K3Config
        (the shapes: :mod:`k3.config.hf`)."""
        text, vision, wrapper = split_wrapper(d)
        kw, extra, views = text_kwargs(text, cls.text_field_names())
        cfg = cls._construct(kw, extra)
        check_hf_keys(cfg, views)
        if wrapper is not None:
            cfg.wrapper, cfg.vision_config = wrapper, vision
        return cfg

    @classmethod
    def _construct(cls, kw: dict[str, Any], extra: dict[str, Any]) -> "K3Config":
        """K3Config(**kw): a ``kimi_linear`` config that uses K3-only features (what k3 wrote before
        K3 configs had their own model_type) is read as ``kimi_k3_text``, with a notice."""
        if kw.get("model_type") != "kimi_linear":
            return cls(**kw, extra=extra)
        cfg = cls(**{**kw, "model_type": "kimi_k3_text"}, extra=extra)
        features = cfg.k3_only_features()
        if features:
            log.info("config says model_type='kimi_linear' but uses %s (not in Kimi-Linear): read as "
                     "'kimi_k3_text'", ", ".join(features))
        else:
            cfg.model_type = "kimi_linear"
        return cfg

    @classmethod
    def from_json(cls, path_or_text: str | os.PathLike) -> "K3Config":
        """Load from a config.json path, a checkpoint directory, or a JSON string."""
        d, where = read_json(path_or_text)
        try:
            return cls.from_dict(d)
        except ConfigError as e:
            raise ConfigError(f"{where}: {e}") from None

    def replace(self, **changes: Any) -> "K3Config":
        """A validated copy with some schema fields changed (``linear_attn_config`` may be a dict).

        Passed-through keys (``extra``: e.g. ``architectures``, ``torch_dtype``, ``auto_map``), the
        wrapper and ``vision_config`` are carried over untouched; an unknown field name is refused.
        """
        refuse_unknown(changes, self.text_field_names(), "K3Config.replace")
        kw = {name: copy.deepcopy(getattr(self, name)) for name in self.text_field_names()}
        kw.update(copy.deepcopy(changes))
        if "linear_attn_config" in changes and isinstance(kw["linear_attn_config"], LinearAttnConfig):
            kw["linear_attn_config"] = kw["linear_attn_config"].to_dict()
        extra = {k: copy.deepcopy(v) for k, v in self.extra.items()
                 if not (k.endswith("_token_ids") and k[:-1] in changes)}  # an HF id list replaced
        return K3Config(**kw, vision_config=copy.deepcopy(self.vision_config),
                        wrapper=copy.deepcopy(self.wrapper), extra=extra)

    def fingerprint(self) -> tuple:
        """What a cache or checkpoint must agree with to be used with this config."""
        return tuple(sorted((k, json.dumps(v, sort_keys=True)) for k, v in self.to_text_dict().items()))


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)
