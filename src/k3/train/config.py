"""TrainConfig: every option of a training run as plain data (SPEC §5).

Precedence, lowest first: the dataclass defaults, the per-preset defaults in ``PRESET_DEFAULTS``
(a curriculum and batch shape that suit the model), a ``--config run.toml`` file (top-level keys
are the field names below; ``[model_overrides]`` is a table of K3Config fields), then command-line
flags. ``TrainConfig.validate`` names the offending field; ``resolve_model_config`` turns the
preset / config.json plus the ablation switches into the K3Config the run trains.

The context-length curriculum is data (modded-nanogpt habit): ``[[start, seq_len], ...]`` stages as
in :class:`k3.train.schedule.ContextCurriculum`, where ``start`` is an int step or a float fraction
of ``steps`` (``[[0, 256], [0.4, 512], [0.7, 1024]]`` grows 256 → 512 → 1024 over a run of any
length); on the command line ``--curriculum 0:256,0.4:512,0.7:1024`` or ``--seq-len 512``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from dataclasses import dataclass, field
from typing import Any

from k3.config import K3Config, get_preset
from k3.train.schedule import ContextCurriculum, WSDSchedule

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - python 3.10
    import tomli as tomllib

__all__ = ["TrainConfig", "PRESET_DEFAULTS", "load_toml", "parse_curriculum", "resolve_model_config"]

OPTIMIZERS = ("per_head", "muon", "adamw")
BALANCE_MODES = ("quantile", "sign", "off")

# Per-preset defaults that are applied under a run.toml and flags (never over them).
PRESET_DEFAULTS: dict[str, dict[str, Any]] = {
    "nano": {"batch_size": 8, "curriculum": [[0, 64]], "eval_batches": 4},
    "tiny": {"batch_size": 8, "curriculum": [[0, 256], [0.4, 512], [0.7, 1024]]},
    "small": {"batch_size": 8, "curriculum": [[0, 512], [0.4, 1024], [0.7, 2048]]},
}


@dataclass
class TrainConfig:
    """Options of one training run. ``None`` means "take it from the preset / model config"."""

    # what to train, on what, where
    preset: str = "tiny"
    model_config: str | None = None          # config.json (or checkpoint dir); overrides preset
    model_overrides: dict[str, Any] = field(default_factory=dict)  # K3Config fields
    data: str | None = None                  # None -> Python stdlib corpus
    val_percent: int = 2
    out: str = "runs/tiny"
    # batch shape and length
    steps: int = 1000
    batch_size: int = 8
    grad_accum: int = 1
    curriculum: list[list[float]] | None = None  # [[start step or fraction, seq_len], ...]
    # optimisation
    optimizer: str = "per_head"              # per_head | muon | adamw
    lr: float = 3e-3                         # peak; Muon and AdamW share it (Moonlight scale)
    weight_decay: float = 0.0
    warmup_frac: float = 0.02
    decay_frac: float = 0.3
    min_lr_ratio: float = 0.0
    grad_clip: float = 1.0                   # 0 disables clipping (the norm is still checked)
    max_skips: int = 5                       # stop after this many consecutive skipped steps
    # router balance, quantisation
    balance: str = "quantile"                # quantile | sign | off
    balance_rate: float = 1e-3               # sign-update step size
    qat: bool = False
    qk_clip: float | None = None             # QK-Clip τ for MLA max logits (None: off)
    dtype: str = "fp32"                      # fp32 | bf16 (autocast; fp32 master weights, KDA state)
    # ablations (None: as the model config says)
    attn_res: bool | None = None
    hidden_act: str | None = None            # situ | silu
    # cadence
    log_interval: int = 10
    eval_interval: int = 100                 # 0: only at the end
    eval_batches: int = 8                    # validation batches per eval (0: the whole split)
    final_eval_batches: int = 0              # at the end (0: the whole split)
    ckpt_interval: int = 200                 # 0: only at the end / on a signal
    # runtime
    seed: int = 0
    threads: int = 0                         # 0: torch's default
    device: str = "cpu"
    plot: bool = True

    # ----------------------------------------------------------------------------- building
    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def from_dict(cls, d: dict[str, Any], where: str = "config") -> "TrainConfig":
        unknown = sorted(set(d) - set(cls.field_names()))
        if unknown:
            raise ValueError(f"{where}: unknown option(s) {unknown}; known: {cls.field_names()}")
        return cls(**d)

    @classmethod
    def build(cls, toml_path: str | None = None, overrides: dict[str, Any] | None = None) -> "TrainConfig":
        """Defaults < preset defaults < ``toml_path`` < ``overrides`` (flags), then validated."""
        layers: dict[str, Any] = {}
        if toml_path:
            layers.update(load_toml(toml_path))
        layers.update({k: v for k, v in (overrides or {}).items() if v is not None})
        preset = layers.get("preset", cls.preset)
        merged = dict(PRESET_DEFAULTS.get(preset, {})) if not layers.get("model_config") else {}
        merged.update(layers)
        tc = cls.from_dict(merged, toml_path or "options")
        tc.validate()
        return tc

    def to_dict(self) -> dict[str, Any]:
        return json.loads(json.dumps(dataclasses.asdict(self)))

    def replace(self, **changes: Any) -> "TrainConfig":
        tc = dataclasses.replace(self, **changes)
        tc.validate()
        return tc

    # --------------------------------------------------------------------------- derived
    def context_curriculum(self) -> ContextCurriculum:
        """The curriculum with fractional starts turned into steps of this run."""
        stages = self.curriculum or [[0, 256]]
        steps = []
        for start, seq in stages:
            step = round(start * self.steps) if isinstance(start, float) else int(start)
            if steps and step <= steps[-1][0]:
                raise ValueError(f"curriculum {stages} has stages that start at the same or an earlier "
                                 f"step ({step}) with steps={self.steps}")
            steps.append((step, int(seq)))
        return ContextCurriculum(steps)

    def lr_schedule(self) -> WSDSchedule:
        return WSDSchedule.from_fractions(self.steps, self.warmup_frac, self.decay_frac,
                                          min_lr_ratio=self.min_lr_ratio, peak_lr=self.lr)

    @property
    def max_seq_len(self) -> int:
        return max(int(seq) for _, seq in (self.curriculum or [[0, 256]]))

    # -------------------------------------------------------------------------- validation
    def validate(self) -> None:
        def pos_int(name: str, allow_zero: bool = False) -> None:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < (0 if allow_zero else 1):
                raise ValueError(f"{name} must be an int {'>= 0' if allow_zero else '> 0'}, got {v!r}")

        for name in ("steps", "batch_size", "grad_accum", "max_skips", "log_interval"):
            pos_int(name)
        for name in ("eval_interval", "eval_batches", "final_eval_batches", "ckpt_interval",
                     "threads", "seed", "val_percent"):
            pos_int(name, allow_zero=True)
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {self.optimizer!r}")
        if self.balance not in BALANCE_MODES:
            raise ValueError(f"balance must be one of {BALANCE_MODES}, got {self.balance!r}")
        if self.dtype not in ("fp32", "bf16"):
            raise ValueError(f"dtype must be 'fp32' or 'bf16', got {self.dtype!r}")
        if self.qk_clip is not None and (isinstance(self.qk_clip, bool) or not isinstance(
                self.qk_clip, (int, float)) or not self.qk_clip > 0):
            raise ValueError(f"qk_clip must be a threshold > 0 (or unset), got {self.qk_clip!r}")
        if self.hidden_act not in (None, "situ", "silu"):
            raise ValueError(f"hidden_act must be 'situ' or 'silu', got {self.hidden_act!r}")
        for name in ("lr", "balance_rate"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("weight_decay", "grad_clip"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("warmup_frac", "decay_frac", "min_lr_ratio"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)}")
        if self.warmup_frac + self.decay_frac > 1.0:
            raise ValueError(f"warmup_frac + decay_frac must be <= 1, got "
                             f"{self.warmup_frac} + {self.decay_frac}")
        if not isinstance(self.model_overrides, dict):
            raise ValueError("model_overrides must be a table of K3Config fields")
        self._validate_curriculum()

    def _validate_curriculum(self) -> None:
        cur = self.curriculum
        if cur is None:
            return
        if not isinstance(cur, list) or not cur:
            raise ValueError(f"curriculum must be a non-empty list of [start, seq_len], got {cur!r}")
        for stage in cur:
            if not isinstance(stage, (list, tuple)) or len(stage) != 2:
                raise ValueError(f"curriculum stage must be [start, seq_len], got {stage!r}")
            start, seq = stage
            if isinstance(seq, bool) or not isinstance(seq, int) or seq < 2:
                raise ValueError(f"curriculum seq_len must be an int >= 2, got {seq!r}")
            if isinstance(start, bool) or not isinstance(start, (int, float)) or start < 0 \
                    or (isinstance(start, float) and start >= 1.0):
                raise ValueError(f"curriculum start must be a step (int >= 0) or a fraction of the "
                                 f"run in [0, 1), got {start!r}")
        if cur[0][0] != 0:
            raise ValueError(f"the first curriculum stage must start at 0, got {cur[0][0]!r}")
        self.context_curriculum()


def parse_curriculum(text: str) -> list[list[float]]:
    """``"0:256,0.4:512,0.7:1024"`` (a start with a dot is a fraction of the run) -> stages."""
    stages: list[list[float]] = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        start, sep, seq = part.partition(":")
        try:
            if not sep:
                raise ValueError
            stages.append([float(start) if "." in start else int(start), int(seq)])
        except ValueError:
            raise ValueError(f"curriculum stage {part!r} is not START:SEQ_LEN "
                             "(e.g. 0:256,0.5:512)") from None
    if not stages:
        raise ValueError(f"empty curriculum {text!r}")
    return stages


def load_toml(path: str | os.PathLike) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            d = tomllib.load(f)
    except FileNotFoundError:
        raise FileNotFoundError(f"run config not found: {path}") from None
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"{path}: not valid TOML ({e})") from None
    unknown = sorted(set(d) - set(TrainConfig.field_names()))
    if unknown:
        raise ValueError(f"{path}: unknown option(s) {unknown}")
    return d


def resolve_model_config(tc: TrainConfig) -> K3Config:
    """The K3Config of the run: preset or config.json, model_overrides, then the ablation switches.

    Raises ValueError when the longest curriculum stage exceeds max_position_embeddings.
    """
    cfg = K3Config.from_json(tc.model_config) if tc.model_config else get_preset(tc.preset)
    changes = dict(tc.model_overrides)
    if tc.attn_res is False:
        changes["attn_res_block_size"] = None
    elif tc.attn_res is True and changes.get("attn_res_block_size", cfg.attn_res_block_size) is None:
        raise ValueError("attn_res=true needs attn_res_block_size in the model config "
                         "(set it under [model_overrides])")
    if tc.hidden_act is not None:
        changes["hidden_act"] = tc.hidden_act
    if changes:
        cfg = cfg.replace(**changes)
    if tc.max_seq_len > cfg.max_position_embeddings:
        raise ValueError(f"curriculum sequence length {tc.max_seq_len} exceeds the model's "
                         f"max_position_embeddings={cfg.max_position_embeddings}")
    return cfg
