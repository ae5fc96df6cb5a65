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

from k3.config import (K3Config, check_bool, check_choice, check_float, check_int, get_preset,
                       list_presets, refuse_unknown)
from k3.errors import ConfigError
from k3.train.schedule import ContextCurriculum, WSDSchedule

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - python 3.10
    import tomli as tomllib

__all__ = ["TrainConfig", "InitDir", "init_model_dir", "PRESET_DEFAULTS", "load_toml", "parse_curriculum", "resolve_model_config",
           "check_device", "max_threads", "SEED_MAX"]

OPTIMIZERS = ("per_head", "muon", "adamw")
BALANCE_MODES = ("quantile", "sign", "off")
SEED_MAX = 2**64 - 1  # torch.manual_seed takes a uint64
SFT_SEQ_LEN = 1024    # an SFT run's rows when no seq_len is given (an agent episode of a small task fits)

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
    # fine-tuning (k3 sft): start from a checkpoint's weights, model config and tokenizer
    init_from: str | None = None             # run dir, checkpoint folder or model dir with tokenizer.json
    sft_data: str | None = None              # chat JSONL file or directory (k3.data.sft): an SFT run
    skip_bad: bool = False                   # SFT: count and report bad rows instead of stopping
    include_failed: bool = False             # SFT: also train on trajectories whose verdict did not pass
    vision: str | None = None                # SFT: add a new vision tower of this preset (nano|tiny|small) to a text model
    freeze_vision: bool = False              # SFT of a vision model: the tower's weights stay fixed (the projector trains)
    out: str = "runs/tiny"
    # batch shape and length
    steps: int = 1000
    batch_size: int = 8
    grad_accum: int = 1
    curriculum: list[list[float]] | None = None  # [[start step or fraction, seq_len], ...]
    # optimisation
    optimizer: str = "per_head"              # per_head | muon | adamw
    ns_dtype: str = "bf16"                   # bf16 | fp32: Muon's Newton-Schulz iteration (bf16 as Muon's reference)
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
    compile_attn_res: bool = False           # torch.compile the AttnRes mixing (opt-in; not bit-equal to eager)
    capacity_factor: float | None = None     # MoE capacity C = ceil(f·N·k/E) (None: dropless)
    qb_bins: int | None = None               # histogram QB bins (None: exact; 1024 when distributed)
    # distributed (torchrun; k3.train.distributed): mesh dp x ep, world size = dp * ep
    dp: int | None = None                    # data-parallel degree (None: world size / ep)
    ep: int = 1                              # expert-parallel degree (each rank holds E/ep experts)
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
    threads: int | str = "auto"              # auto (k3.threads) | N | 0: torch's default
    device: str = "cpu"
    plot: bool = True

    # ----------------------------------------------------------------------------- building
    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def from_dict(cls, d: Any, where: str = "config") -> "TrainConfig":
        """Options from a dict (not yet validated); unknown keys are refused with a did-you-mean."""
        if not isinstance(d, dict):
            raise ConfigError(f"{where}: expected a table of options, got {type(d).__name__}")
        refuse_unknown(d, cls.field_names(), where)
        return cls(**d)

    @classmethod
    def build(cls, toml_path: str | None = None, overrides: dict[str, Any] | None = None) -> "TrainConfig":
        """Defaults < preset defaults < ``toml_path`` < ``overrides`` (flags), then validated."""
        layers: dict[str, Any] = {}
        if toml_path:
            layers.update(load_toml(toml_path))
        layers.update({k: v for k, v in (overrides or {}).items() if v is not None})
        preset = layers.get("preset", cls.preset)
        defaults = PRESET_DEFAULTS.get(preset, {}) if isinstance(preset, str) else {}
        merged = dict(defaults) if not (layers.get("model_config") or layers.get("init_from")) else {}
        if layers.get("sft_data") and not layers.get("curriculum"):
            merged["curriculum"] = [[0, SFT_SEQ_LEN]]
        merged.update(layers)
        tc = cls.from_dict(merged, toml_path or "options")
        tc.validate()
        return tc

    def to_dict(self) -> dict[str, Any]:
        return json.loads(json.dumps(dataclasses.asdict(self)))

    def replace(self, **changes: Any) -> "TrainConfig":
        refuse_unknown(changes, self.field_names(), "TrainConfig.replace")
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
                raise ConfigError(f"curriculum {stages} has stages that start at the same or an earlier "
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
        """Check every option's type and range; :class:`ConfigError` names the option.

        Booleans must be ``true``/``false`` (``qat = "no"`` is refused, not read as true), floats
        finite, ints bounded: ``seed`` in [0, 2^64) (``torch.manual_seed``'s range), ``threads``
        ``"auto"`` or at most ``os.cpu_count()`` (more OpenMP threads than cores only slows a run
        down, and very large counts crash the OpenMP runtime), ``device`` one this torch build can use.
        """
        for name in ("steps", "batch_size", "grad_accum", "max_skips", "log_interval"):
            check_int(name, getattr(self, name), lo=1)
        for name in ("eval_interval", "eval_batches", "final_eval_batches", "ckpt_interval"):
            check_int(name, getattr(self, name), lo=0)
        check_int("val_percent", self.val_percent, lo=0, hi=99)
        check_int("seed", self.seed, lo=0, hi=SEED_MAX)
        check_int("ep", self.ep, lo=1)
        if self.dp is not None:
            check_int("dp", self.dp, lo=1)
        if self.qb_bins is not None:
            check_int("qb_bins", self.qb_bins, lo=2, hi=1 << 20)
            if self.balance != "quantile":
                raise ConfigError(f"qb_bins applies to balance='quantile', not balance={self.balance!r}")
        if self.capacity_factor is not None:
            check_float("capacity_factor", self.capacity_factor, lo=0.0, lo_open=True)
        from k3.threads import parse_threads
        if (threads := parse_threads(self.threads)) != "auto":
            check_int("threads", threads, lo=0, hi=max_threads())
        for name in ("qat", "plot", "compile_attn_res", "skip_bad", "include_failed", "freeze_vision"):
            check_bool(name, getattr(self, name))
        check_bool("attn_res", self.attn_res, allow_none=True)
        for name in ("preset", "out"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise ConfigError(f"{name} must be a non-empty string, got {getattr(self, name)!r}")
        for name in ("model_config", "data", "init_from", "sft_data"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                raise ConfigError(f"{name} must be a path string, got {getattr(self, name)!r}")
        check_choice("preset", self.preset, list_presets())
        check_choice("optimizer", self.optimizer, OPTIMIZERS)
        check_choice("balance", self.balance, BALANCE_MODES)
        check_choice("hidden_act", self.hidden_act, ("situ", "silu"), allow_none=True)
        check_choice("dtype", self.dtype, ("fp32", "bf16"))
        check_choice("ns_dtype", self.ns_dtype, ("bf16", "fp32"))
        if self.qk_clip is not None:
            check_float("qk_clip", self.qk_clip, lo=0.0, lo_open=True)
        for name in ("lr", "balance_rate"):
            check_float(name, getattr(self, name), lo=0.0, lo_open=True)
        for name in ("weight_decay", "grad_clip"):
            check_float(name, getattr(self, name), lo=0.0)
        for name in ("warmup_frac", "decay_frac", "min_lr_ratio"):
            check_float(name, getattr(self, name), lo=0.0, hi=1.0)
        if self.warmup_frac + self.decay_frac > 1.0:
            raise ConfigError(f"warmup_frac + decay_frac must be <= 1, got "
                              f"{self.warmup_frac} + {self.decay_frac}")
        if not isinstance(self.model_overrides, dict):
            raise ConfigError(f"model_overrides must be a table of K3Config fields, got {self.model_overrides!r}")
        refuse_unknown(self.model_overrides, K3Config.text_field_names(), "model_overrides")
        check_device("device", self.device)
        self._validate_curriculum()
        self._validate_fine_tuning()

    def _validate_fine_tuning(self) -> None:
        if self.init_from is not None:
            for name in ("model_config", "attn_res", "hidden_act"):
                if getattr(self, name) is not None:
                    raise ConfigError(f"{name} cannot be combined with init_from: the model comes "
                                      f"from the checkpoint {self.init_from}")
            if self.model_overrides:
                raise ConfigError(f"model_overrides cannot be combined with init_from: the model "
                                  f"comes from the checkpoint {self.init_from}")
        if self.sft_data is None:
            for name in ("skip_bad", "include_failed", "vision", "freeze_vision"):
                if getattr(self, name):
                    raise ConfigError(f"{name} applies to sft_data (an SFT run), which is not set")
            return
        if self.vision is not None:
            from k3.config.presets import vision_preset
            if not isinstance(self.vision, str) or self.vision not in list_presets() \
                    or vision_preset(self.vision) is None:
                raise ConfigError(f"vision must name a preset with a vision tower "
                                  f"(nano, tiny, small, k3), got {self.vision!r}")
        if self.init_from is None:
            raise ConfigError("sft_data needs init_from: fine-tuning starts from a trained checkpoint "
                              "(its tokenizer has the chat tokens)")
        if self.data is not None:
            raise ConfigError("data (a pretraining corpus) and sft_data (conversations) are exclusive")
        if self.curriculum is not None and len(self.curriculum) > 1:
            raise ConfigError(f"sft_data packs conversations at one sequence length; curriculum has "
                              f"{len(self.curriculum)} stages (use seq_len)")

    def _validate_curriculum(self) -> None:
        cur = self.curriculum
        if cur is None:
            return
        if not isinstance(cur, list) or not cur:
            raise ConfigError(f"curriculum must be a non-empty list of [start, seq_len], got {cur!r}")
        for stage in cur:
            if not isinstance(stage, (list, tuple)) or len(stage) != 2:
                raise ConfigError(f"curriculum stage must be [start, seq_len], got {stage!r}")
            start, seq = stage
            check_int("curriculum seq_len", seq, lo=2)
            if isinstance(start, float):
                check_float("curriculum start (a fraction of the run)", start, lo=0.0)
                if start >= 1.0:
                    raise ConfigError(f"curriculum start must be a step (int >= 0) or a fraction of "
                                      f"the run in [0, 1), got {start!r}")
            else:
                check_int("curriculum start (a step)", start, lo=0)
        if cur[0][0] != 0:
            raise ConfigError(f"the first curriculum stage must start at 0, got {cur[0][0]!r}")
        self.context_curriculum()


def max_threads() -> int:
    """The most ``threads`` a run may ask for: the machine's logical CPUs."""
    return os.cpu_count() or 1


def check_device(name: str, device: Any) -> None:
    """``device`` names a device this torch build has: ``cpu``, ``cuda[:i]`` or ``mps``."""
    import torch

    if not isinstance(device, str):
        raise ConfigError(f"{name} must be a string such as 'cpu' or 'cuda', got {device!r}")
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError, TypeError):
        raise ConfigError(f"{name}={device!r} is not a torch device (cpu, cuda, cuda:1, mps)") from None
    if dev.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ConfigError(f"{name}={device!r}: this torch build ({torch.__version__}) has no CUDA "
                              "device available; use cpu")
        if dev.index is not None and dev.index >= count:
            raise ConfigError(f"{name}={device!r}: only {count} CUDA device(s) are available")
    elif dev.type == "mps":
        if not torch.backends.mps.is_available():
            raise ConfigError(f"{name}={device!r}: MPS is not available on this machine")
    elif dev.type != "cpu":
        raise ConfigError(f"{name}={device!r}: training runs on cpu, cuda or mps")


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
            raise ConfigError(f"curriculum stage {part!r} is not START:SEQ_LEN "
                             "(e.g. 0:256,0.5:512)") from None
    if not stages:
        raise ConfigError(f"empty curriculum {text!r}")
    return stages


def load_toml(path: str | os.PathLike) -> dict[str, Any]:
    """A run.toml's options; an unknown or misspelled key is refused with a did-you-mean."""
    try:
        with open(path, "rb") as f:
            d = tomllib.load(f)
    except FileNotFoundError:
        raise FileNotFoundError(f"run config not found: {path}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: not valid TOML ({e})") from None
    refuse_unknown(d, TrainConfig.field_names(), os.fspath(path))
    return d


@dataclass(frozen=True)
class InitDir:
    """Where a fine-tuning run's starting point lives: the model directory and its tokenizer."""
    model: Any            # Path of config.json + safetensors
    tokenizer: Any        # Path of tokenizer.json


def init_model_dir(path: str) -> InitDir:
    """``init_from`` resolved: a run directory (its verified current checkpoint), a checkpoint
    folder, or a model directory with ``tokenizer.json`` beside ``config.json``."""
    from pathlib import Path

    from k3.checkpoint.training import find_checkpoint, verify_checkpoint

    p = Path(path)
    if not p.is_dir():
        raise ConfigError(f"init_from {path}: no such directory")
    if not (p / "trainer_state.pt").is_file() and not (p / "config.json").is_file():
        ckpt = find_checkpoint(p)
        if ckpt is None:
            raise ConfigError(f"init_from {path}: neither a run with a checkpoint, a checkpoint folder "
                              "nor a model directory (config.json)")
        p = ckpt
    elif (p / "trainer_state.pt").is_file():
        verify_checkpoint(p)
    model = p / "model" if (p / "trainer_state.pt").is_file() else p
    tok = p / "tokenizer.json"
    if not (model / "config.json").is_file():
        raise ConfigError(f"init_from {path}: {model} has no config.json")
    if not tok.is_file():
        raise ConfigError(f"init_from {path}: no tokenizer.json beside the model")
    return InitDir(model.resolve(), tok.resolve())


def _add_vision(cfg: K3Config, tc: TrainConfig, init: InitDir | None) -> K3Config:
    """``vision``: the text model ``cfg`` with a new tower of that preset, its ``<|media_pad|>`` id the
    checkpoint tokenizer's."""
    from k3.config.presets import vision_preset
    from k3.config.vision import with_vision
    from k3.data.tokenizer import Tokenizer

    if cfg.vision_config is not None:
        raise ConfigError(f"vision={tc.vision!r}: the checkpoint {tc.init_from} already has a vision tower "
                          "(leave vision out to fine-tune it)")
    media = Tokenizer.load(init.tokenizer).media_token_ids if init is not None else None
    if media is None:
        raise ConfigError(f"vision={tc.vision!r}: the checkpoint's tokenizer has no media tokens "
                          "(<|media_begin|> ... <|media_pad|>): it was trained by k3 before vision; "
                          "pretrain with a current k3 to add a vision tower")
    return with_vision(cfg, vision_preset(tc.vision), media["<|media_pad|>"])


def resolve_model_config(tc: TrainConfig, init: InitDir | None = None) -> K3Config:
    """The K3Config of the run: the init_from checkpoint's, or preset or config.json with
    model_overrides, then the ablation switches.

    Raises ConfigError when the longest curriculum stage exceeds max_position_embeddings.
    """
    if tc.init_from is not None and init is None:
        init = init_model_dir(tc.init_from)
    if init is not None:
        cfg = K3Config.from_json(str(init.model / "config.json"))
    else:
        cfg = K3Config.from_json(tc.model_config) if tc.model_config else get_preset(tc.preset)
    changes = dict(tc.model_overrides)
    if tc.attn_res is False:
        changes["attn_res_block_size"] = None
    elif tc.attn_res is True and changes.get("attn_res_block_size", cfg.attn_res_block_size) is None:
        raise ConfigError("attn_res=true needs attn_res_block_size in the model config "
                         "(set it under [model_overrides])")
    if tc.hidden_act is not None:
        changes["hidden_act"] = tc.hidden_act
    if changes:
        cfg = cfg.replace(**changes)
    if tc.compile_attn_res and cfg.attn_res_block_size is None:
        raise ConfigError("compile_attn_res=true needs Block AttnRes, which this model has off "
                         "(attn_res_block_size is None or attn_res=false)")
    if tc.vision is not None:
        cfg = _add_vision(cfg, tc, init)
    if tc.max_seq_len > cfg.max_position_embeddings:
        raise ConfigError(f"curriculum sequence length {tc.max_seq_len} exceeds the model's "
                         f"max_position_embeddings={cfg.max_position_embeddings}")
    return cfg
