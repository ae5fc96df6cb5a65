"""K3 configuration: one dataclass whose fields are the HF ``kimi_linear`` / ``kimi_k3`` names.

``K3Config`` describes the text model (SPEC §2). It reads and writes three ``config.json`` shapes:

* a flat text config with a ``linear_attn_config`` dict (Moonshot's Kimi-Linear / K3 text config),
* the same but written by transformers (``layer_types`` / ``mlp_layer_types`` / ``linear_*`` fields),
* the multimodal ``kimi_k3`` wrapper (``text_config`` + ``vision_config``).

Layer lists in ``linear_attn_config`` are 1-indexed, as released; ``kda_layer_ids`` and
``mla_layer_ids`` give the 0-indexed sets the model uses. Unknown keys are kept in ``extra`` so a
file round-trips. Validation runs on construction and names the offending field.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any

__all__ = ["LinearAttnConfig", "K3Config", "PRESETS", "get_preset", "list_presets"]


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
    def from_dict(cls, d: dict[str, Any]) -> "LinearAttnConfig":
        if not isinstance(d, dict):
            raise TypeError(f"linear_attn_config must be a dict, got {type(d).__name__}")
        kw = {k: d[k] for k in cls._KNOWN if k in d}
        extra = {k: v for k, v in d.items() if k not in cls._KNOWN}
        return cls(**kw, extra=extra)

    def to_dict(self) -> dict[str, Any]:
        d = {k: copy.deepcopy(getattr(self, k)) for k in self._KNOWN}
        d.update(copy.deepcopy(self.extra))
        return d


def _k3_layer_split(num_layers: int, period: int = 4) -> tuple[list[int], list[int]]:
    """1-indexed (kda, full) lists: full attention every ``period``-th layer and at the last."""
    full = [i for i in range(1, num_layers + 1) if i % period == 0 or i == num_layers]
    kda = [i for i in range(1, num_layers + 1) if i not in full]
    return kda, full


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
    mla_use_nope: bool = True
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
    num_nextn_predict_layers: int = 0
    initializer_range: float = 0.02
    bos_token_id: int | None = 163584
    eos_token_id: int | None = 163585
    pad_token_id: int | None = 163839
    model_type: str = "kimi_linear"
    # multimodal wrapper (kept verbatim until vision lands)
    vision_config: dict[str, Any] | None = None
    wrapper: dict[str, Any] | None = None  # non-text keys of a kimi_k3 wrapper config
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if isinstance(self.linear_attn_config, dict):
            self.linear_attn_config = LinearAttnConfig.from_dict(self.linear_attn_config)
        lac = self.linear_attn_config
        if not lac.kda_layers and not lac.full_attn_layers:
            lac.kda_layers, lac.full_attn_layers = _k3_layer_split(self.num_hidden_layers)
        self.validate()

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
        def pos(name: str, allow_none: bool = False) -> None:
            v = getattr(self, name)
            if v is None and allow_none:
                return
            if isinstance(v, bool) or not isinstance(v, int):
                raise TypeError(f"{name} must be an int, got {v!r}")
            if v <= 0:
                raise ValueError(f"{name} must be > 0, got {v}")

        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                     "kv_lora_rank", "qk_nope_head_dim", "v_head_dim", "intermediate_size",
                     "max_position_embeddings", "num_expert_group", "topk_group"):
            pos(name)
        for name in ("q_lora_rank", "routed_expert_hidden_size", "attn_res_block_size"):
            pos(name, allow_none=True)
        for name in ("qk_rope_head_dim", "num_experts", "num_shared_experts", "first_k_dense_replace",
                     "num_nextn_predict_layers"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{name} must be an int >= 0, got {v!r}")
        if self.rms_norm_eps <= 0:
            raise ValueError(f"rms_norm_eps must be > 0, got {self.rms_norm_eps}")
        if self.mla_latent_norm_eps is not None and self.mla_latent_norm_eps <= 0:
            raise ValueError(f"mla_latent_norm_eps must be > 0, got {self.mla_latent_norm_eps}")
        if self.hidden_act not in ("situ", "silu"):
            raise ValueError(f"hidden_act must be 'situ' or 'silu', got {self.hidden_act!r}")
        if self.hidden_act == "situ" and self.activation_situ_beta <= 0:
            raise ValueError(f"activation_situ_beta must be > 0, got {self.activation_situ_beta}")
        if self.activation_situ_linear_beta is not None and self.activation_situ_linear_beta <= 0:
            raise ValueError("activation_situ_linear_beta must be > 0 or None, "
                             f"got {self.activation_situ_linear_beta}")
        if self.moe_router_activation_func not in ("sigmoid", "softmax"):
            raise ValueError("moe_router_activation_func must be 'sigmoid' or 'softmax', "
                             f"got {self.moe_router_activation_func!r}")
        if self.num_experts > 0:
            pos("moe_intermediate_size")
            pos("num_experts_per_token")
            if self.num_experts % self.num_expert_group:
                raise ValueError(f"num_experts ({self.num_experts}) must be divisible by "
                                 f"num_expert_group ({self.num_expert_group})")
            if self.topk_group > self.num_expert_group:
                raise ValueError(f"topk_group ({self.topk_group}) must be <= num_expert_group "
                                 f"({self.num_expert_group})")
            reachable = self.topk_group * (self.num_experts // self.num_expert_group)
            if self.num_experts_per_token > reachable:
                raise ValueError(f"num_experts_per_token ({self.num_experts_per_token}) exceeds the "
                                 f"{reachable} experts reachable with topk_group={self.topk_group}")
        self._validate_layers()

    def _validate_layers(self) -> None:
        lac = self.linear_attn_config
        n = self.num_hidden_layers
        for name in ("num_heads", "head_dim", "short_conv_kernel_size"):
            v = getattr(lac, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"linear_attn_config.{name} must be an int > 0, got {v!r}")
        if lac.gate_lower_bound is not None and not lac.gate_lower_bound < 0:
            raise ValueError(f"linear_attn_config.gate_lower_bound must be < 0 or None, "
                             f"got {lac.gate_lower_bound}")
        seen: dict[int, str] = {}
        for kind, layers in (("KDA", lac.kda_layers), ("MLA", lac.full_attn_layers)):
            for i in layers:
                if isinstance(i, bool) or not isinstance(i, int):
                    raise TypeError(f"linear_attn_config layer ids must be ints, got {i!r}")
                if not 1 <= i <= n:
                    raise ValueError(f"{kind} layer {i} is out of range: linear_attn_config layer ids are "
                                     f"1-indexed and num_hidden_layers={n}")
                if i in seen:
                    if seen[i] == kind:
                        raise ValueError(f"layer {i} listed twice as {kind}")
                    raise ValueError(f"layer {i} listed as both KDA and MLA")
                seen[i] = kind
        missing = [i for i in range(1, n + 1) if i not in seen]
        if missing:
            raise ValueError(f"layers {missing} (1-indexed) are neither KDA nor MLA in linear_attn_config")

    # -------------------------------------------------------------- serialising
    _WRAPPER_KEYS = ("text_config", "vision_config")

    def to_text_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            if f.name in ("vision_config", "wrapper", "extra"):
                continue
            v = getattr(self, f.name)
            d[f.name] = v.to_dict() if isinstance(v, LinearAttnConfig) else copy.deepcopy(v)
        d.update(copy.deepcopy(self.extra))
        return d

    def to_dict(self) -> dict[str, Any]:
        """The config.json dict: the kimi_k3 wrapper when this config came from one."""
        text = self.to_text_dict()
        if self.wrapper is None and self.vision_config is None:
            return text
        out = copy.deepcopy(self.wrapper or {"model_type": "kimi_k3", "architectures": ["KimiK3ForConditionalGeneration"]})
        out["text_config"] = text
        if self.vision_config is not None:
            out["vision_config"] = copy.deepcopy(self.vision_config)
        return out

    def to_json(self, path: str | os.PathLike | None = None) -> str:
        s = json.dumps(self.to_dict(), indent=2, sort_keys=False) + "\n"
        if path is not None:
            with open(path, "w") as f:
                f.write(s)
        return s

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "K3Config":
        if not isinstance(d, dict):
            raise TypeError(f"a config must be a JSON object, got {type(d).__name__}")
        if "text_config" in d:
            text = d["text_config"]
            if not isinstance(text, dict):
                raise TypeError("text_config must be a JSON object")
            wrapper = {k: copy.deepcopy(v) for k, v in d.items() if k not in cls._WRAPPER_KEYS}
            cfg = cls._from_text_dict(text)
            cfg.wrapper = wrapper
            cfg.vision_config = copy.deepcopy(d.get("vision_config"))
            return cfg
        return cls._from_text_dict(d)

    @classmethod
    def _from_text_dict(cls, d: dict[str, Any]) -> "K3Config":
        d = copy.deepcopy(d)
        names = {f.name for f in dataclasses.fields(cls)} - {"vision_config", "wrapper", "extra"}
        # HF aliases (transformers' KimiLinearConfig attribute_map)
        for alias, name in (("num_experts_per_tok", "num_experts_per_token"),
                            ("n_shared_experts", "num_shared_experts"),
                            ("num_local_experts", "num_experts"),
                            ("norm_topk_prob", "moe_renormalize"),
                            ("n_group", "num_expert_group")):
            if alias in d and name not in d:
                d[name] = d.pop(alias)
        if "max_position_embeddings" not in d and "model_max_length" in d:  # transformers' attribute_map
            d["max_position_embeddings"] = d.pop("model_max_length")
        d = _kimi_linear_defaults(d)
        if "linear_attn_config" not in d and "layer_types" in d:
            d["linear_attn_config"] = _linear_cfg_from_transformers(d)
            if "mla_latent_norm_eps" not in d:
                d["mla_latent_norm_eps"] = 1e-6  # transformers' Kimi-Linear MLA latent norms
        if d.get("model_type") == "kimi_linear" and "mla_latent_norm_eps" not in d:
            # Moonshot's Kimi-Linear code and transformers use 1e-6 for the MLA latent norms;
            # configs written by k3 always carry the field explicitly.
            d["mla_latent_norm_eps"] = 1e-6
        kw = {k: d.pop(k) for k in list(d) if k in names}
        for tid in ("eos_token_id", "bos_token_id", "pad_token_id"):
            if isinstance(kw.get(tid), list):  # HF allows a list of ids; keep the first, preserve all
                d[f"{tid}s"] = kw[tid]
                kw[tid] = kw[tid][0]
        try:
            return cls(**kw, extra=d)
        except TypeError as e:
            raise TypeError(f"invalid config: {e}") from None

    @classmethod
    def from_json(cls, path_or_text: str | os.PathLike) -> "K3Config":
        """Load from a config.json path, a checkpoint directory, or a JSON string."""
        src = os.fspath(path_or_text)
        if os.path.isdir(src):
            src = os.path.join(src, "config.json")
        if os.path.exists(src):
            try:
                with open(src) as f:
                    d = json.load(f)
            except json.JSONDecodeError as e:
                raise ValueError(f"{src}: not valid JSON ({e})") from None
        else:
            try:
                d = json.loads(src)
            except json.JSONDecodeError:
                raise FileNotFoundError(f"no config file at {src!r} (and it is not a JSON string)") from None
        return cls.from_dict(d)

    def replace(self, **changes: Any) -> "K3Config":
        """A validated copy with some fields changed (``linear_attn_config`` may be a dict)."""
        d = self.to_text_dict()
        d.update(changes)
        cfg = K3Config._from_text_dict_exact(d)
        cfg.vision_config, cfg.wrapper = copy.deepcopy(self.vision_config), copy.deepcopy(self.wrapper)
        return cfg

    @classmethod
    def _from_text_dict_exact(cls, d: dict[str, Any]) -> "K3Config":
        names = {f.name for f in dataclasses.fields(cls)} - {"vision_config", "wrapper", "extra"}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"unknown config field(s): {unknown}")
        return cls(**copy.deepcopy(d))

    def fingerprint(self) -> tuple:
        """What a cache or checkpoint must agree with to be used with this config."""
        return tuple(sorted((k, json.dumps(v, sort_keys=True)) for k, v in self.to_text_dict().items()))


# Fields that exist only in K3. A kimi_linear config holding none of them is a Kimi-Linear model,
# whose values for them differ from K3Config's (K3) defaults.
_KIMI_LINEAR_DEFAULTS = {"routed_expert_hidden_size": None, "latent_moe_use_norm": False,
                         "mla_use_output_gate": False, "attn_res_block_size": None,
                         "activation_situ_linear_beta": None, "hidden_act": "silu"}


def _kimi_linear_defaults(d: dict[str, Any]) -> dict[str, Any]:
    if d.get("model_type") != "kimi_linear" or any(k in d for k in _KIMI_LINEAR_DEFAULTS if k != "hidden_act"):
        return d
    for k, v in _KIMI_LINEAR_DEFAULTS.items():
        d.setdefault(k, v)
    if isinstance(d.get("linear_attn_config"), dict):
        d["linear_attn_config"] = {"gate_lower_bound": None, "use_full_rank_gate": False,
                                   **d["linear_attn_config"]}
    return d


def _linear_cfg_from_transformers(d: dict[str, Any]) -> dict[str, Any]:
    """Build ``linear_attn_config`` from transformers' ``layer_types``/``linear_*`` fields."""
    types = d["layer_types"]
    kda = [i + 1 for i, t in enumerate(types) if t == "linear_attention"]
    full = [i + 1 for i, t in enumerate(types) if t == "full_attention"]
    other = [t for t in types if t not in ("linear_attention", "full_attention")]
    if other:
        raise ValueError(f"layer_types holds unknown types {sorted(set(map(str, other)))}")
    if len(types) != d.get("num_hidden_layers", len(types)):
        raise ValueError(f"layer_types has {len(types)} entries but num_hidden_layers="
                         f"{d.get('num_hidden_layers')}")
    mlp_types = d.get("mlp_layer_types")
    if mlp_types is not None and "first_k_dense_replace" not in d:
        dense = [i for i, t in enumerate(mlp_types) if t == "dense"]
        if dense != list(range(len(dense))):
            raise ValueError("mlp_layer_types: dense layers must be a prefix of the stack")
        d["first_k_dense_replace"] = len(dense)
    return {
        "kda_layers": kda,
        "full_attn_layers": full,
        "num_heads": d.get("linear_num_heads", 32),
        "head_dim": d.get("linear_head_dim", 128),
        "short_conv_kernel_size": d.get("linear_conv_kernel_dim", 4),
        "gate_lower_bound": None,
        "use_full_rank_gate": False,
    }


# ---------------------------------------------------------------------- presets
def _k3() -> K3Config:
    return K3Config(eos_token_id=163586)


def _kimi_linear_48b() -> K3Config:
    n = 27
    full = [4, 8, 12, 16, 20, 24, 27]
    return K3Config(
        vocab_size=163840, hidden_size=2304, num_hidden_layers=n,
        linear_attn_config=LinearAttnConfig(
            kda_layers=[i for i in range(1, n + 1) if i not in full], full_attn_layers=full,
            num_heads=32, head_dim=128, short_conv_kernel_size=4, gate_lower_bound=None,
            use_full_rank_gate=False),
        num_attention_heads=32, q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128,
        qk_rope_head_dim=64, v_head_dim=128, mla_use_output_gate=False, mla_latent_norm_eps=1e-6,
        intermediate_size=9216, first_k_dense_replace=1, num_experts=256, num_experts_per_token=8,
        num_shared_experts=1, moe_intermediate_size=1024, routed_expert_hidden_size=None,
        latent_moe_use_norm=False, routed_scaling_factor=2.446, hidden_act="silu",
        activation_situ_linear_beta=None, attn_res_block_size=None, eos_token_id=163586,
    )


def _small_preset(vocab: int, hidden: int, layers: int, heads: int, head_dim: int, q_lora: int,
                  kv_lora: int, nope: int, rope: int, v: int, inter: int, experts: int, topk: int,
                  moe_inter: int, latent: int, block: int, max_pos: int) -> K3Config:
    kda, full = _k3_layer_split(layers)
    return K3Config(
        vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers,
        linear_attn_config=LinearAttnConfig(kda_layers=kda, full_attn_layers=full, num_heads=heads,
                                            head_dim=head_dim),
        num_attention_heads=heads, q_lora_rank=q_lora, kv_lora_rank=kv_lora, qk_nope_head_dim=nope,
        qk_rope_head_dim=rope, v_head_dim=v, intermediate_size=inter, num_experts=experts,
        num_experts_per_token=topk, num_shared_experts=1, moe_intermediate_size=moe_inter,
        routed_expert_hidden_size=latent, attn_res_block_size=block, max_position_embeddings=max_pos,
        bos_token_id=None, eos_token_id=0, pad_token_id=None, mla_latent_norm_eps=None,
    )


PRESETS = {
    "nano": lambda: _small_preset(512, 64, 4, 2, 32, 32, 32, 16, 8, 16, 128, 8, 2, 32, 32, 2, 2048),
    "tiny": lambda: _small_preset(4096, 256, 8, 4, 64, 128, 64, 32, 16, 32, 768, 16, 4, 128, 128, 4, 8192),
    "small": lambda: _small_preset(8192, 512, 12, 8, 64, 256, 128, 64, 32, 64, 1536, 32, 4, 256, 256, 4, 16384),
    "kimi-linear-48b": _kimi_linear_48b,
    "k3": _k3,
}


def list_presets() -> list[str]:
    return list(PRESETS)


def get_preset(name: str, **overrides: Any) -> K3Config:
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {list_presets()}")
    cfg = PRESETS[name]()
    return cfg.replace(**overrides) if overrides else cfg
