"""Vision configuration (SPEC §3.9): the release's ``vision_config`` and the image size rule.

:class:`VisionConfig` holds the MoonViT3d tower + ``patchmergerv2`` projector fields under the
names of the released ``config.json`` (``vt_hidden_size``, ``qkv_hidden_size``, ...), so the
release's ``vision_config`` parses and writes back identically (keys sorted, as transformers
writes them). A key left out takes the release's value, as the reference configuration class does.
Every field is read by :mod:`k3.model.vision` or accepted only at the value it implements; an
unknown key is refused naming it. transformers' generic keys (``model_type``, ``id2label``, ...)
are kept verbatim in ``extra``.

Not in the release's vision_config, so constants here: the tower's RMSNorm eps (``nn.RMSNorm``
with eps=None computes in fp32 with ``finfo(float32).eps``) and the 2-D RoPE base θ = 10000.

:class:`ImageProcConfig` holds the preprocessing numbers (``media_proc_cfg`` names) and the NaViT
size rule; normalization is ``(u8/255 − mean)/std`` per channel.

``K3Config.vision_config`` stays a verbatim dict (checkpoints of other vision towers load their
text model unchanged); :func:`vision_config_of` parses and checks it against the text model.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field, fields
from typing import Any

from k3.config.checks import check_bool, check_choice, check_float, check_int, refuse_unknown
from k3.errors import ConfigError

__all__ = ["VisionConfig", "ImageProcConfig", "vision_config_of", "RELEASE_VISION_CONFIG",
           "TOWER_NORM_EPS", "ROPE_THETA"]

# nn.RMSNorm(eps=None) computes in fp32 with finfo(float32).eps = 2⁻²³ (torch ≥ 2.6); written out, so that
# importing the configs does not load torch (k3.threads sets OpenMP up before torch loads)
TOWER_NORM_EPS = 2.0 ** -23
ROPE_THETA = 10000.0
# transformers' PretrainedConfig keys a re-saved vision_config carries; kept verbatim, never read
_HF_GENERIC = frozenset((
    "_name_or_path", "architectures", "model_type", "dtype", "torch_dtype", "transformers_version",
    "id2label", "label2id", "return_dict", "output_attentions", "output_hidden_states",
    "chunk_size_feed_forward", "is_encoder_decoder", "is_decoder", "problem_type", "pruned_heads",
    "tie_word_embeddings", "add_cross_attention", "use_bfloat16", "torchscript", "tf_legacy_loss"))


@dataclass
class VisionConfig:
    """The release's ``vision_config`` (field names as published; defaults are the release's)."""

    patch_size: int = 14
    init_pos_emb_height: int = 64
    init_pos_emb_width: int = 64
    init_pos_emb_time: int = 4                 # frames with a sin/cos time term (t ≤ this)
    pos_emb_type: str = "divided_fixed"
    pos_emb_interpolation_mode: str = "bilinear"
    vt_hidden_size: int = 1024
    vt_num_hidden_layers: int = 27
    vt_num_attention_heads: int = 12
    qkv_hidden_size: int = 1536                # heads × head_dim (≠ vt_hidden_size in K3)
    vt_intermediate_size: int = 4096
    norm_type: str = "rmsnorm"
    activation_func: str = "gelu_pytorch_tanh"
    mlp_type: str = "mlp2"
    attn_bias: bool = False
    linear_bias: bool = False
    patch_embed_proj_bias: bool = False
    merge_kernel_size: list[int] = field(default_factory=lambda: [2, 2])
    merge_type: str = "sd2_tpool"
    mm_projector_type: str = "patchmergerv2"
    mm_hidden_size: int | None = 1024          # null -> vt_hidden_size
    projector_hidden_act: str = "gelu"
    projector_ln_eps: float = 1e-5
    text_hidden_size: int = 7168
    # written only when set: the reference's attention kernel (any name; the release's file says
    # "flash_attention_2", transformers' re-save drops it) and a key the release's file lacks
    _attn_implementation: str | None = None
    video_attn_type: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    _OPTIONAL = ("_attn_implementation", "video_attn_type")

    def __post_init__(self) -> None:
        self.validate()

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls) if f.name != "extra"]

    # ------------------------------------------------------------------ derived
    @property
    def head_dim(self) -> int:
        return self.qkv_hidden_size // self.vt_num_attention_heads

    @property
    def merge_area(self) -> int:
        return self.merge_kernel_size[0] * self.merge_kernel_size[1]

    @property
    def projector_dim(self) -> int:
        """Width of a merged token: merge area × tower width (4096 in K3)."""
        return self.merge_area * (self.mm_hidden_size or self.vt_hidden_size)

    # --------------------------------------------------------------- validation
    def validate(self) -> None:
        """Every field's type and range; values the model does not implement are refused."""
        for name in ("patch_size", "init_pos_emb_height", "init_pos_emb_width", "init_pos_emb_time",
                     "vt_hidden_size", "vt_num_hidden_layers", "vt_num_attention_heads", "qkv_hidden_size",
                     "vt_intermediate_size", "text_hidden_size"):
            check_int(f"vision_config.{name}", getattr(self, name), lo=1)
        check_int("vision_config.mm_hidden_size", self.mm_hidden_size, lo=1, allow_none=True)
        for name in ("attn_bias", "linear_bias", "patch_embed_proj_bias"):
            check_bool(f"vision_config.{name}", getattr(self, name))
        check_float("vision_config.projector_ln_eps", self.projector_ln_eps, lo=0.0, lo_open=True)
        for name, choices in (("pos_emb_type", ("divided_fixed",)),
                              ("pos_emb_interpolation_mode", ("bilinear", "bicubic")),
                              ("norm_type", ("rmsnorm",)), ("activation_func", ("gelu_pytorch_tanh",)),
                              ("mlp_type", ("mlp2",)), ("merge_type", ("sd2_tpool",)),
                              ("mm_projector_type", ("patchmergerv2",)), ("projector_hidden_act", ("gelu",))):
            check_choice(f"vision_config.{name}", getattr(self, name), choices)
        check_choice("vision_config.video_attn_type", self.video_attn_type, ("spatial_temporal",),
                     allow_none=True)
        if not isinstance(self._attn_implementation, (str, type(None))):
            raise ConfigError(f"vision_config._attn_implementation must be a string or null, "
                              f"got {self._attn_implementation!r}")
        mk = self.merge_kernel_size
        if not (isinstance(mk, list) and len(mk) == 2):
            raise ConfigError(f"vision_config.merge_kernel_size must be a list [kh, kw], got {mk!r}")
        for v in mk:
            check_int("vision_config.merge_kernel_size entry", v, lo=1)
        if self.qkv_hidden_size % self.vt_num_attention_heads:
            raise ConfigError(f"vision_config.vt_num_attention_heads ({self.vt_num_attention_heads}) must "
                              f"divide vision_config.qkv_hidden_size ({self.qkv_hidden_size})")
        if self.head_dim % 4:
            raise ConfigError(f"vision_config head dim qkv_hidden_size/vt_num_attention_heads = "
                              f"{self.head_dim} must be a multiple of 4 (2-D RoPE rotates pairs per axis)")
        if self.mm_hidden_size is not None and self.mm_hidden_size != self.vt_hidden_size:
            raise ConfigError(f"vision_config.mm_hidden_size ({self.mm_hidden_size}) must equal "
                              f"vt_hidden_size ({self.vt_hidden_size}) or be null: the projector reads "
                              "the tower's merged tokens")
        if not isinstance(self.extra, dict):
            raise ConfigError(f"vision_config.extra must be a JSON object, got {self.extra!r}")
        refuse_unknown(self.extra, _HF_GENERIC, "vision_config")

    # -------------------------------------------------------------- serialising
    @classmethod
    def from_dict(cls, d: Any) -> "VisionConfig":
        """A config.json ``vision_config`` -> validated VisionConfig (unknown keys refused by name)."""
        if not isinstance(d, dict):
            raise ConfigError(f"vision_config must be a JSON object, got {d!r}")
        known = cls.field_names()
        refuse_unknown(d, [*known, *_HF_GENERIC], "vision_config")
        kw = {k: copy.deepcopy(v) for k, v in d.items() if k in known}
        return cls(**kw, extra={k: copy.deepcopy(v) for k, v in d.items() if k not in known})

    def to_dict(self) -> dict[str, Any]:
        """The config.json dict, keys sorted; optional fields only when set."""
        d = {k: copy.deepcopy(getattr(self, k)) for k in self.field_names()
             if not (k in self._OPTIONAL and getattr(self, k) is None)}
        d.update(copy.deepcopy(self.extra))
        return dict(sorted(d.items()))


# the released K3 config.json's vision_config, key for key
RELEASE_VISION_CONFIG: dict[str, Any] = VisionConfig(_attn_implementation="flash_attention_2").to_dict()


def vision_config_of(config) -> VisionConfig | None:
    """``config.vision_config`` (a K3Config's dict) parsed, with the projector's output checked
    against the text model's width; None for a text-only config."""
    if config.vision_config is None:
        return None
    vc = VisionConfig.from_dict(config.vision_config)
    if vc.text_hidden_size != config.hidden_size:
        raise ConfigError(f"vision_config.text_hidden_size ({vc.text_hidden_size}) must equal the text "
                          f"model's hidden_size ({config.hidden_size}): projected image rows replace "
                          "token embeddings")
    return vc


@dataclass
class ImageProcConfig:
    """Image preprocessing (``media_proc_cfg`` names; K3 values from the research note §1).

    Scale = min(1, √(in_patch_limit / patches), side/W, side/H) with side = patch_limit_on_one_side ·
    patch_size (7168 px), never up; pad with black to a multiple of merge · patch (28 px).
    """

    patch_size: int = 14
    merge_kernel_size: list[int] = field(default_factory=lambda: [2, 2])
    in_patch_limit: int = 65536
    patch_limit_on_one_side: int = 512
    image_mean: list[float] = field(default_factory=lambda: [0.5, 0.5, 0.5])
    image_std: list[float] = field(default_factory=lambda: [0.5, 0.5, 0.5])

    def __post_init__(self) -> None:
        for name in ("patch_size", "in_patch_limit", "patch_limit_on_one_side"):
            check_int(f"media_proc_cfg.{name}", getattr(self, name), lo=1)
        mk = self.merge_kernel_size
        if not (isinstance(mk, list) and len(mk) == 2):
            raise ConfigError(f"media_proc_cfg.merge_kernel_size must be a list [kh, kw], got {mk!r}")
        for v in mk:
            check_int("media_proc_cfg.merge_kernel_size entry", v, lo=1)
        for name in ("image_mean", "image_std"):
            v = getattr(self, name)
            if not (isinstance(v, list) and len(v) == 3):
                raise ConfigError(f"media_proc_cfg.{name} must be a list of 3 numbers, got {v!r}")
            for x in v:
                check_float(f"media_proc_cfg.{name} entry", x, lo=0.0 if name == "image_std" else None,
                            lo_open=name == "image_std")

    @classmethod
    def from_dict(cls, d: Any) -> "ImageProcConfig":
        if not isinstance(d, dict):
            raise ConfigError(f"media_proc_cfg must be a JSON object, got {d!r}")
        refuse_unknown(d, [f.name for f in fields(cls)], "media_proc_cfg")
        return cls(**copy.deepcopy(d))

    def to_dict(self) -> dict[str, Any]:
        return {f.name: copy.deepcopy(getattr(self, f.name)) for f in fields(self)}

    @property
    def max_side(self) -> int:
        """Largest side in pixels after the resize (7168 in K3)."""
        return self.patch_limit_on_one_side * self.patch_size

    @property
    def pad_multiple(self) -> tuple[int, int]:
        """(rows, cols) multiple in pixels the padded image has (28, 28 in K3)."""
        return self.merge_kernel_size[0] * self.patch_size, self.merge_kernel_size[1] * self.patch_size

    def resize_size(self, width: int, height: int) -> tuple[int, int]:
        """(new_w, new_h) of a width × height image (``int()`` truncates; never upscales)."""
        check_int("image width", width, lo=1)
        check_int("image height", height, lo=1)
        p = self.patch_size
        patches = max(1, width // p) * max(1, height // p)
        scale = min(1.0, math.sqrt(self.in_patch_limit / patches), self.max_side / width,
                    self.max_side / height)
        return (min(max(1, int(width * scale)), self.max_side),
                min(max(1, int(height * scale)), self.max_side))

    def grid_thw(self, width: int, height: int) -> tuple[int, int, int]:
        """(t, h, w) patch grid of the resized, padded image (t = 1)."""
        new_w, new_h = self.resize_size(width, height)
        fh, fw = self.pad_multiple
        return 1, -(-new_h // fh) * fh // self.patch_size, -(-new_w // fw) * fw // self.patch_size

    def num_tokens(self, width: int, height: int) -> int:
        """Merged tokens (``<|media_pad|>`` count) of a width × height image."""
        _, h, w = self.grid_thw(width, height)
        return (h // self.merge_kernel_size[0]) * (w // self.merge_kernel_size[1])


# The kimi_k3 wrapper's key for the <|media_pad|> id (163605 in the release).
MEDIA_PAD_KEY = "media_placeholder_token_id"


def image_proc_for(vc: VisionConfig) -> ImageProcConfig:
    """The release's preprocessing (``media_proc_cfg``) with the tower's patch size and merge kernel."""
    return ImageProcConfig(patch_size=vc.patch_size, merge_kernel_size=list(vc.merge_kernel_size))


def with_vision(config, vc: VisionConfig, media_pad_token_id: int):
    """A copy of the text config ``config`` with a vision tower: ``vc`` projecting into its width,
    and the kimi_k3 wrapper naming ``media_pad_token_id`` (the tokenizer's ``<|media_pad|>``)."""
    from k3.config.hf import DEFAULT_WRAPPER

    if config.vision_config is not None:
        raise ConfigError("the model already has a vision tower (its config has a vision_config)")
    check_int("media_pad_token_id", media_pad_token_id, lo=0)
    if media_pad_token_id >= config.vocab_size:
        raise ConfigError(f"media_pad_token_id {media_pad_token_id} is outside the vocabulary "
                          f"[0, {config.vocab_size})")
    out = config.replace()
    d = vc.to_dict()
    d["text_hidden_size"] = config.hidden_size
    out.vision_config = VisionConfig.from_dict(d).to_dict()
    out.wrapper = {**copy.deepcopy(config.wrapper or DEFAULT_WRAPPER), MEDIA_PAD_KEY: media_pad_token_id}
    return out
