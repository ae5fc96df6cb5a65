"""The training loop (SPEC §5): ONE Trainer for one process (CPU or one GPU) and for a torchrun job.

What differs between the two is the Trainer's parallelism object (``k3.train.parallel``):
``SingleProcess`` (every reduction the identity) or ``k3.train.distributed.Distributed`` (dp × ep
mesh, FSDP2, expert parallelism, DCP checkpoints); ``Trainer(tc)`` picks it.

Per optimizer step s (0-based; records and checkpoints count completed steps, s + 1)::

    seq_len = curriculum(s); lr = WSD(s); N = labels (≠ IGNORE) in the step's micro-batches, all processes
    for each of grad_accum micro-batches:          (routing uses the bias from step s − 1)
        loss = ΣCE(model(x, stats), y) / N; loss.backward(); collect the forward's router stats
        (+ MLA max logits: the ForwardStats the forward filled, k3.model.stats)
    g = clip_grad_norm_(params, grad_clip)
    if loss or g is not finite: skip the step (no update, reason logged); stop after max_skips in a row
    else: optimizer.step() (not when every gradient is exactly 0: no update, the record says
          no_update); QK-Clip (if qk_clip); router biases ← balance(stats of step s)

``dtype='bf16'`` runs forward and backward under bf16 autocast: the parameters, gradients and
optimizer state stay fp32 (master weights), and the fp32 islands stay fp32 (router, KDA
recurrence and state, AttnRes mixing, norms, the loss).

Resuming from a checkpoint reproduces the uninterrupted run bit-exactly on CPU at a fixed
``threads`` (``auto`` may change the count between steps, and with it the last bits: k3.threads):
the model (with its router biases), optimizer, data cursor, RNG states, step and skip counter are
restored, and everything else (lr, seq_len) is a function of the step.
"""

from __future__ import annotations

import math
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

import torch

from k3.checkpoint.rundir import RunLock, check_foreign_dir, claim_run_dir, mark_resumed_run
from k3.checkpoint.training import (check_free_space, find_checkpoint, load_model_weights, load_trainer_state,
                                    rng_state, set_rng_state)
from k3.config import K3Config
from k3.data.batches import StridedBatches
from k3.data.corpus import Corpus, load_corpus
from k3.data.packing import IGNORE_INDEX, build_token_stream, eval_batches
from k3.data.sft import ChatData, read_chat_rows
from k3.data.tokenizer import Tokenizer, get_tokenizer
from k3.errors import CheckpointError, ConfigError
from k3.config.vision import image_proc_for, vision_config_of
from k3.model.decoder import K3ForCausalLM
from k3.model.multimodal import K3VLForConditionalGeneration
from k3.model.stats import ForwardStats
from k3.ops.loss import cross_entropy
from k3.threads import thread_control
from k3.train.balance import RouterBalancer
from k3.train.config import TrainConfig, init_model_dir, resolve_model_config
from k3.train.distributed import parallel_for
from k3.train.metrics import MemoryMetrics, MetricsLog, Progress, plot_run
from k3.train.optim import QKClip, build_param_groups, cpu_bf16_matmul_is_native
from k3.train.parallel import Parallelism
from k3.train.runinfo import absolute_paths, checkpoint_bytes, corpus_difference, write_run_info

__all__ = ["Trainer", "TrainResult", "TrainingDiverged", "token_byte_lengths"]

_NS_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
_OPTIMIZER_MODES = {"per_head": "per_head", "muon": "full", "adamw": "adamw"}


def _autocast_dtype(dtype: str, device: torch.device) -> torch.dtype | None:
    """None for fp32; torch.bfloat16 for 'bf16' where the device supports it (else an error)."""
    if dtype == "fp32":
        return None
    if device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise ConfigError(f"dtype=bf16: device {device} does not support bfloat16")
    return torch.bfloat16


def _quiet(*args: Any, **kwargs: Any) -> None:
    """The print of a process other than rank 0."""


class _NoLock:
    """What a process other than rank 0 holds instead of the run lock."""

    def release(self) -> None:
        pass


class _InMemoryData:
    """What run.json and the checkpoints say about an in-memory batch source (``Trainer(batches=)``)."""

    name = "in-memory batches"

    def __init__(self, source: Any):
        self.fingerprint = str(getattr(source, "fingerprint", None) or type(source).__qualname__)

    def doc_digests(self) -> dict[str, str]:
        return {}

    def counts(self) -> dict[str, int]:
        return {}

    def summary(self) -> str:
        return f"data: {self.name} ({self.fingerprint})"


class TrainingDiverged(RuntimeError):
    """Raised after ``max_skips`` consecutive steps with a non-finite loss or gradient."""


@dataclass
class TrainResult:
    run_dir: Path
    step: int
    status: str                      # "done" | "interrupted"
    losses: list[float | None] = field(default_factory=list)  # per step of this process (None: skipped)
    val: dict[str, float] | None = None


def token_byte_lengths(tok: Tokenizer) -> torch.Tensor:
    """UTF-8 bytes each token id stands for [V] int64 (special tokens: 0).

    A byte-level BPE token string spells each byte with one character of the GPT-2 byte alphabet,
    so its length is its byte count (decoding single tokens would mangle split UTF-8 sequences).
    """
    specials = {i for i in tok.hf.get_added_tokens_decoder()}
    lens = [0 if i in specials else len(tok.id_to_token(i) or "") for i in range(tok.vocab_size)]
    return torch.tensor(lens, dtype=torch.int64)


class Trainer:
    """Builds a run from a TrainConfig (fresh, or resumed from ``tc.out``) and trains it.

    ``on_step_start(trainer, step)`` callbacks run before each step's first forward (tests inject
    faults there); ``on_step_end(trainer, record)`` after the step and the bias update.

    ``objective`` (post-training, e.g. ``k3.rl.grpo``) replaces what a step learns from, with the
    rest of the trainer (optimizer, schedule, checkpoints, resume, signals) unchanged: it builds
    the run's data (``build_data(trainer, ckpt, saved)`` sets ``tokenizer``, ``corpus`` with a
    ``name``, ``fingerprint``, ``doc_digests()`` and ``counts()``, ``curriculum``, ``schedule``,
    ``token_bytes`` and ``data``), says how many micro-batches (at least one) the coming step has
    (``micro_batches(trainer)``; a stop signal while it prepares them drops the step) and
    gives each micro-batch's loss summed over its trained tokens (``loss(trainer, *micro)``; a
    micro-batch's second tensor holds the targets, ``IGNORE_INDEX`` where nothing is trained, so
    every trained token of the step weighs the same), and whether micro-batch i only keeps this
    process in step with the others (``is_padding(trainer, i)``: it trains nothing and its routing
    is not counted by the balancer); its loss runs the model through :meth:`forward`, which hands
    the forward's router statistics to the balancer. An objective's run has no validation loss.

    ``batches`` (a pretraining run on in-memory data, e.g. a synthetic token stream) replaces the
    corpus: an object with ``next_batch(seq_len) -> (inputs [B, T], targets [B, T], *packed
    documents)`` (targets already shifted, ``IGNORE_INDEX`` where nothing is trained),
    ``state_dict()`` and ``load_state_dict(state)`` (the resumable cursor) and optionally a
    ``fingerprint`` string (checked on resume) and ``tokenizer`` (the ids' tokenizer, saved with each
    checkpoint). Such a run has no validation split.

    ``parallel`` (:class:`k3.train.parallel.Parallelism`): how the run is spread over processes;
    None picks it (``k3.train.distributed.parallel_for``: ``Distributed`` under torchrun or to
    resume a distributed checkpoint, else ``SingleProcess``). Only rank 0 prints, plots, writes
    metrics and run.json and holds the run directory's lock.
    """

    def __init__(self, tc: TrainConfig, resume: bool = False, print_fn: Callable[[str], None] = print,
                 tty: bool | None = None, overwrite: bool = False,
                 read_rows: Callable[[str], Iterable[tuple[str, Any]]] = read_chat_rows,
                 objective: Any = None, parallel: Parallelism | None = None, batches: Any = None):
        tc = absolute_paths(tc)
        if batches is not None and (objective is not None or tc.sft_data is not None):
            raise ConfigError("batches (an in-memory batch source) replaces a pretraining run's corpus; it "
                              "cannot be combined with " + ("an objective" if objective is not None else "sft_data"))
        for name in ("next_batch", "state_dict", "load_state_dict"):
            if batches is not None and not callable(getattr(batches, name, None)):
                raise ConfigError(f"batches: {type(batches).__name__} has no {name}() (a batch source needs "
                                  "next_batch(seq_len), state_dict() and load_state_dict(state))")
        self.parallel: Parallelism = parallel if parallel is not None else \
            parallel_for(tc, resume, rows=objective is None)
        tc = self.parallel.configure(tc)
        main = self.parallel.rank == 0
        self.progress_stream = None if main else open(os.devnull, "w")
        self.tc, self.print = tc, (print_fn if main else _quiet)
        self.objective, self.batches = objective, batches
        self.read_rows = read_rows  # SFT rows from tc.sft_data (k3.rl.sft adds trajectories)
        self.run_dir = Path(tc.out)
        self.lock = self._open_run_dir(resume)  # held until train() returns (or close())
        try:
            self._setup(resume, tty if main else False, overwrite)
        except BaseException:
            self.lock.release()
            raise

    def _open_run_dir(self, resume: bool):
        """Check (fresh: not someone else's folder) or find (resume) the run dir; lock it (rank 0;
        the other processes wait for it and hold no lock)."""
        lock = _NoLock()
        if self.parallel.rank == 0:
            if not resume:
                check_foreign_dir(self.run_dir)  # before the lock file goes into someone else's folder
                self.run_dir.mkdir(parents=True, exist_ok=True)
            elif not self.run_dir.is_dir():
                raise CheckpointError(f"nothing to resume: {self.run_dir} does not exist")
            lock = RunLock(self.run_dir).acquire()
        self.parallel.barrier()
        return lock

    def close(self) -> None:
        """Release the run directory's lock (train() does so when it returns)."""
        self.lock.release()

    def __del__(self) -> None:
        lock = self.__dict__.get("lock")
        if lock is not None:
            try:
                lock.release()
            except Exception:  # noqa: BLE001 - interpreter shutdown: the OS drops the flock anyway
                pass

    def _setup(self, resume: bool, tty: bool | None, overwrite: bool) -> None:
        tc = self.tc
        self.tty = tty
        self.on_step_start: list[Callable[["Trainer", int], None]] = []
        self.on_step_end: list[Callable[["Trainer", dict], None]] = []
        self.stop_signal: int | None = None
        self._pending_signal: int | None = None   # a distributed run acts on it at the next step
        self._micro_stats: ForwardStats | None = None  # the running micro-batch's (Trainer.forward)
        self.device = torch.device(tc.device)
        self.threads = thread_control(tc.threads, self.device.type)  # None: a fixed count
        torch.set_flush_denormal(True)

        ckpt, saved = self._checkpoint_to_resume(resume, overwrite)
        self.init_dir = init_model_dir(tc.init_from) if tc.init_from and saved is None else None
        if saved is not None and tc.init_from:  # resuming a fine-tuning run needs only its own checkpoint
            self.model_config = K3Config.from_dict(saved["model_config"])
        else:
            self.model_config = resolve_model_config(tc, self.init_dir)
        if saved is not None:
            self._check_same_model(K3Config.from_dict(saved["model_config"]))
        torch.manual_seed(tc.seed)
        self._build_data(ckpt, saved)
        self.model = self._new_model()
        if saved is None and self.init_dir is not None:  # a fine-tuning run starts from these weights
            self._load_init_weights()
        if tc.freeze_vision:
            if not isinstance(self.model, K3VLForConditionalGeneration):
                raise ConfigError("freeze_vision: the model has no vision tower (add one with vision=PRESET)")
            self.model.vision_tower.requires_grad_(False)
        for moe in self.model.moe_layers():
            moe.capacity_factor = tc.capacity_factor
        if tc.qat:
            from k3.train.qat import enable_qat
            enable_qat(self.model)
        if tc.compile_attn_res:   # resolve_model_config refused it for a model without AttnRes
            self.model.compile_attn_res()
        self.model.to(self.device)
        self.parallel.parallelize(self.model, tc, self.model_config)
        groups = build_param_groups(self.model, self.model_config, tc.lr, tc.weight_decay,
                                    _OPTIMIZER_MODES[tc.optimizer])
        self.optimizer = self.parallel.optimizer_class(groups, lr=tc.lr, weight_decay=tc.weight_decay,
                                                       ns_dtype=_NS_DTYPES[tc.ns_dtype])
        self.balancer = RouterBalancer(self.model, tc.balance, tc.balance_rate, bins=tc.qb_bins,
                                       reduce=self.parallel.balancer_reduce)
        self.qk_clip = QKClip(self.model, tc.qk_clip, self.model_config) if tc.qk_clip else None
        self.autocast_dtype = _autocast_dtype(tc.dtype, self.device)
        if self.autocast_dtype is not None and self.device.type == "cpu" and not cpu_bf16_matmul_is_native():
            self.print("dtype=bf16: this CPU has no oneDNN bf16 matmul kernels (they need AVX-512); torch runs "
                       "its bf16 matmuls in a generic loop, many times slower than fp32 (--dtype fp32)")
        self.step, self.skips, self.tokens_seen = 0, 0, 0
        self.last_saved_step: int | None = None
        records: list[dict] = []
        if saved is not None:
            self.parallel.load_checkpoint(ckpt, saved, self.model, self.optimizer, self.model_config, self.device)
            self.data.load_state_dict(saved["data"])
            self.step, self.skips = saved["step"], saved["skips"]
            self.tokens_seen = saved["tokens_seen"]
            records = saved["metrics"]
            self.last_saved_step = self.step
            set_rng_state(saved["rng"])  # last: building the model above consumed random numbers
        check_free_space(self.run_dir, checkpoint_bytes(self))  # fail now, not after training
        main = self.parallel.rank == 0
        self.metrics = MetricsLog(self.run_dir, records) if main else MemoryMetrics(records)
        if main:
            write_run_info(self, resumed_from=self.step if saved is not None else None)

    def _new_model(self) -> torch.nn.Module:
        """K3ForCausalLM, or K3VLForConditionalGeneration for a config with a vision tower (whose
        ``<|media_pad|>`` id must be the tokenizer's)."""
        if self.model_config.vision_config is None:
            return K3ForCausalLM(self.model_config)
        model = K3VLForConditionalGeneration(self.model_config)
        media = self.tokenizer.media_token_ids
        if media is None or media["<|media_pad|>"] != model.media_pad_token_id:
            have = "none" if media is None else media["<|media_pad|>"]
            raise ConfigError(f"the model's media_placeholder_token_id is {model.media_pad_token_id} but the "
                              f"tokenizer's <|media_pad|> id is {have}: images would land on other tokens")
        return model

    def _load_init_weights(self) -> None:
        """The init checkpoint's weights; a text checkpoint given a new tower (``vision``) loads
        into the text model and the tower keeps its seeded initialisation."""
        if self.tc.vision is not None:
            load_model_weights(self.model.language_model, self.init_dir.model)
        else:
            load_model_weights(self.model, self.init_dir.model)

    # ------------------------------------- for objectives (post-training): the run's processes
    @property
    def rank(self) -> int:
        """This process's index among the run's processes (one process: 0)."""
        return self.parallel.rank

    @property
    def world(self) -> int:
        """How many processes train this run (one process: 1)."""
        return self.parallel.world

    def gather_objects(self, obj: Any) -> list:
        """Collective: every process's ``obj`` (picklable), in rank order (one process: [obj])."""
        return self.parallel.gather_objects(obj)

    def reduce_(self, t: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """Collective: ``t`` reduced in place over the processes, ``op`` sum or max (one process: t)."""
        return self.parallel.reduce_(t, op)

    def stop_requested(self) -> int | None:
        """The stop signal this process has received (acted on where the trainer decides), or None."""
        return self.stop_signal if self.stop_signal is not None else self._pending_signal

    def full_model_state(self) -> dict[str, torch.Tensor]:
        """Collective: the whole model's state dict as plain tensors, the same on every process
        (what a ``K3ForCausalLM`` of ``model_config`` loads; one process: the model's own)."""
        return self.parallel.full_state_dict(self.model)

    def param_count(self) -> int:
        """The model's parameters, all processes together (expert parallelism splits the experts)."""
        return self.parallel.param_count(self.model)

    # -------------------------------------------------------------------------------- setup
    def _checkpoint_to_resume(self, resume: bool, overwrite: bool) -> tuple[Path | None, dict | None]:
        """Resume: the verified checkpoint (corrupt -> CheckpointCorrupt naming the file). Fresh:
        claim the folder (refuses foreign folders and existing checkpoints without overwrite).
        Rank 0 claims or marks the folder; the other processes then read the checkpoint."""
        main = self.parallel.rank == 0
        out: tuple[Path | None, dict | None] = (None, None)
        if main and not resume:
            claim_run_dir(self.run_dir, "k3 train", overwrite=overwrite)
        elif main:
            ckpt = find_checkpoint(self.run_dir)
            if ckpt is None:
                raise CheckpointError(f"nothing to resume: {self.run_dir} holds no checkpoint")
            mark_resumed_run(self.run_dir)  # a run from before markers: resuming it shows it is k3's
            out = ckpt, load_trainer_state(ckpt)
        self.parallel.barrier()  # rank 0 has claimed / marked the folder
        if main or not resume:
            return out
        ckpt = find_checkpoint(self.run_dir)
        return ckpt, load_trainer_state(ckpt)

    def _check_same_model(self, old: K3Config) -> None:
        new_fp, old_fp = dict(self.model_config.fingerprint()), dict(old.fingerprint())
        diff = sorted(k for k in set(new_fp) | set(old_fp) if new_fp.get(k) != old_fp.get(k))
        diff += [k for k in ("vision_config", "wrapper")
                 if getattr(self.model_config, k) != getattr(old, k)]
        if diff:
            raise ValueError(f"cannot resume {self.run_dir}: its checkpoint was trained with a "
                             f"different model config (fields that differ: {diff})")

    def _build_data(self, ckpt: Path | None, saved: dict | None) -> None:
        """The run's data (rank 0 first: it fills the tokenizer and token caches the others read),
        then this process's rows of each batch (an objective shares its micro-batches out itself)."""
        main = self.parallel.rank == 0
        if not main:
            self.parallel.barrier()
        if self.objective is not None:
            self.objective.build_data(self, ckpt, saved)
        elif self.batches is not None:
            self._use_batches(saved)
        elif self.tc.sft_data is not None:
            self._build_chat_data(ckpt, saved)
        else:
            self._build_corpus_data(ckpt, saved)
        if main:
            self.parallel.barrier()
        if self.objective is None:
            self.data = self.parallel.shard_batches(self.data, self.tc.batch_size)

    def _use_batches(self, saved: dict | None) -> None:
        """An in-memory batch source (``batches``): no corpus or validation split; its ids' tokenizer
        when it names one (``batches.tokenizer``), saved with every checkpoint."""
        self.corpus = _InMemoryData(self.batches)
        if saved is not None and saved["corpus_fingerprint"] != self.corpus.fingerprint:
            raise CheckpointError(f"cannot resume {self.run_dir}: the batch source's fingerprint "
                                  f"{self.corpus.fingerprint!r} is not the checkpoint's "
                                  f"{saved['corpus_fingerprint']!r}")
        self.tokenizer = getattr(self.batches, "tokenizer", None)
        self.token_bytes = None if self.tokenizer is None else token_byte_lengths(self.tokenizer)
        if self.tokenizer is not None:
            self._check_vocab("the batch source's tokenizer")
        self.curriculum = self.tc.context_curriculum()
        self.schedule = self.tc.lr_schedule()
        self.data = self.batches

    def _check_vocab(self, what: str) -> None:
        """ValueError naming ``what`` when the run's tokenizer has more ids than the model's vocabulary."""
        if self.tokenizer.vocab_size > self.model_config.vocab_size:
            raise ValueError(f"{what} has {self.tokenizer.vocab_size} ids but the model's "
                             f"vocab_size is {self.model_config.vocab_size}")

    def _build_corpus_data(self, ckpt: Path | None, saved: dict | None) -> None:
        """Corpus, tokenizer (the checkpoint's when resuming), token streams, batches, schedules."""
        tc = self.tc
        self.corpus: Corpus = load_corpus(tc.data, tc.val_percent)
        if saved is not None and saved["corpus_fingerprint"] != self.corpus.fingerprint:
            raise CheckpointError(f"cannot resume {self.run_dir}: "
                                  + corpus_difference(saved.get("corpus_docs"), self.corpus))
        if saved is not None:
            self.tokenizer = Tokenizer.load(ckpt / "tokenizer.json")
        else:
            self.tokenizer = get_tokenizer(self.corpus, self.model_config.vocab_size)
        self._check_vocab("tokenizer")
        self.train_tokens = build_token_stream(self.corpus, self.tokenizer, "train", seed=tc.seed)
        self.val_tokens = build_token_stream(self.corpus, self.tokenizer, "validation")
        self.token_bytes = token_byte_lengths(self.tokenizer)
        self.curriculum = tc.context_curriculum()
        self.schedule = tc.lr_schedule()
        need = tc.batch_size * self.curriculum.max_seq_len + 1
        if need > len(self.train_tokens):
            raise ValueError(f"the training split has {len(self.train_tokens):,} tokens but one batch "
                             f"of {tc.batch_size} x {self.curriculum.max_seq_len} needs {need:,}; "
                             "use more data or lower batch_size / seq_len")
        self.data = StridedBatches(self.train_tokens, tc.batch_size, self.curriculum.seq_len_at(0))

    def _build_chat_data(self, ckpt: Path | None, saved: dict | None) -> None:
        """SFT (``sft_data``): the conversations rendered with the tokenizer of the checkpoint the
        run starts from (or resumes), packed into rows of the one sequence length."""
        tc = self.tc
        tok_path = (ckpt / "tokenizer.json") if saved is not None else self.init_dir.tokenizer
        self.tokenizer = Tokenizer.load(tok_path)
        self.curriculum = tc.context_curriculum()
        self.schedule = tc.lr_schedule()
        vc = vision_config_of(self.model_config)
        self.corpus = ChatData(tc.sft_data, self.tokenizer, self.curriculum.max_seq_len, tc.val_percent,
                               skip_bad=tc.skip_bad, include_failed=tc.include_failed,
                               read_rows=self.read_rows, image_proc=None if vc is None else image_proc_for(vc))
        if saved is not None and saved["corpus_fingerprint"] != self.corpus.fingerprint:
            raise CheckpointError(f"cannot resume {self.run_dir}: "
                                  + corpus_difference(saved.get("corpus_docs"), self.corpus))
        for line in self.corpus.bad[:5]:
            self.print(f"skipped: {line}")
        if len(self.corpus.bad) > 5:
            self.print(f"skipped {len(self.corpus.bad) - 5} more bad rows")
        self.token_bytes = token_byte_lengths(self.tokenizer)
        self.data = self.corpus.batches(tc.batch_size, tc.seed)

    def _val_batches(self, max_batches: int):
        if self.tc.sft_data is not None:
            return self.corpus.eval_batches(self.tc.batch_size, max_batches or None)
        return eval_batches(self.val_tokens, self.tc.batch_size, self.curriculum.max_seq_len, max_batches or None)

    # ---------------------------------------------------------------------------- bookkeeping
    def save(self) -> Path:
        """Checkpoint the current state (atomically, in the parallelism's format: k3.checkpoint.training
        for one process, k3.checkpoint.dcp for a distributed run; collective there)."""
        path = self.parallel.save_checkpoint(self.run_dir, self.step, self.model, self.optimizer, self.tokenizer,
                                             self._trainer_state, lambda: checkpoint_bytes(self))
        self.last_saved_step = self.step
        return path

    def _trainer_state(self) -> dict:
        """What trainer_state.pt holds besides the tensors: step, data cursor, RNG, metrics, configs."""
        return {"step": self.step, "skips": self.skips, "tokens_seen": self.tokens_seen,
                "data": self.data.state_dict(), "rng": rng_state(),
                "metrics": self.metrics.records, "train_config": self.tc.to_dict(),
                "model_config": self.model_config.to_dict(),
                "corpus_fingerprint": self.corpus.fingerprint,
                "corpus_docs": self.corpus.doc_digests()}

    # --------------------------------------------------------------------------------- step
    def forward(self, x: torch.Tensor, **kw: Any):
        """The model on ``x`` (moved to the device; ``kw``: the model's other arguments): objectives
        run their micro-batches through this, not ``model(x)``, so that in a training step the
        forward's router statistics (and MLA max logits, for QK-Clip) reach the step's balancer."""
        return self.model(x.to(self.device), stats=self._micro_stats, **kw)

    def _loss(self, x: torch.Tensor, y: torch.Tensor, reduction: str = "mean",
              doc_ids: torch.Tensor | None = None, pixel_values: torch.Tensor | None = None,
              grid_thws: torch.Tensor | None = None) -> torch.Tensor:
        """Next-token CE of a batch (labels already shifted); ``doc_ids``: packed documents;
        ``pixel_values`` / ``grid_thws``: the batch's images (a vision model's SFT rows)."""
        with torch.autocast(self.device.type, dtype=self.autocast_dtype or torch.bfloat16,
                            enabled=self.autocast_dtype is not None):
            kw = {} if doc_ids is None else {"doc_ids": doc_ids.to(self.device)}
            if pixel_values is not None and pixel_values.shape[0]:
                kw.update(pixel_values=pixel_values.to(self.device), grid_thws=grid_thws)
            logits = self.forward(x, **kw).logits
        return cross_entropy(logits.flatten(0, 1), y.to(self.device).flatten(), IGNORE_INDEX, reduction)

    def train_step(self) -> dict:
        """One optimizer step; returns its metrics record (kind 'train' or 'skip'; 'stopped': a stop
        signal dropped it)."""
        if self.parallel.stops_at_step_boundary:   # every process stops at the same step
            flag = self.parallel.reduce_(torch.tensor([self._pending_signal or 0], device=self.device), "max")
            if int(flag) and self.stop_signal is None:
                self.stop_signal = int(flag)
                return {"kind": "stopped", "step": self.step}
        tc, s = self.tc, self.step
        for cb in self.on_step_start:
            cb(self, s)
        seq_len = self.curriculum.seq_len_at(s)
        lr = self.schedule.lr_at(s)
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        self.model.train()
        self.balancer.begin_step()
        if self.qk_clip is not None:
            self.qk_clip.begin_step()
        self.optimizer.zero_grad(set_to_none=True)
        threads = self.threads.before_step() if self.threads else torch.get_num_threads()
        t0 = time.perf_counter()
        loss_sum, reason = 0.0, None
        start = self.data.state_dict(), rng_state()
        # every label of the step weighs the same, whichever micro-batch and process holds it (SFT
        # rows carry different numbers of trained tokens): loss = Σ CE / (labels of the whole step)
        micros = []
        n_micro = self.objective.micro_batches(self) if self.objective is not None else tc.grad_accum
        for _ in range(n_micro):
            if self.stop_signal is not None:  # stop within one micro-batch, here too
                self._abandon_step(*start)
                return {"kind": "stopped", "step": self.step}
            micros.append(self.data.next_batch(seq_len))
        labels = self.parallel.sum([float(sum(int((b[1] != IGNORE_INDEX).sum()) for b in micros))])[0]
        scale = self.parallel.grad_scale / max(labels, 1.0)
        for micro, (x, y, *docs) in enumerate(micros):
            if self.stop_signal is not None:  # stop within one micro-batch: undo this step's part
                self._abandon_step(*start)
                return {"kind": "stopped", "step": self.step}
            stats = self._micro_stats = ForwardStats(max_logits=self.qk_clip is not None)
            try:
                loss = (self._loss(x, y, "sum", *docs) if self.objective is None
                        else self.objective.loss(self, x, y, *docs))
            finally:
                self._micro_stats = None
            lv = self.parallel.sum([loss.item()])[0]
            if not math.isfinite(lv):
                reason = f"non-finite loss ({lv}) in micro-batch {micro}"
                break
            (loss * scale).backward()
            padding = self.objective is not None and self.objective.is_padding(self, micro)
            self.balancer.collect(stats, keep=not padding)
            if self.qk_clip is not None:
                self.qk_clip.collect(stats)
            loss_sum += lv / max(labels, 1.0)
        grad_norm = float("nan")
        if reason is None:
            max_norm = tc.grad_clip if tc.grad_clip > 0 else float("inf")
            self.parallel.sync_grads(self.model)
            grad_norm = self.parallel.clip_grad_norm_(self.model, max_norm)
            if not math.isfinite(grad_norm):
                reason = f"non-finite gradient norm ({grad_norm})"
        tokens = tc.batch_size * seq_len * tc.grad_accum if self.objective is None else int(labels)
        self.step += 1
        self.tokens_seen += tokens
        if reason is not None:
            self.optimizer.zero_grad(set_to_none=True)
            self.balancer.begin_step()
            self.skips += 1
            rec = self.metrics.log("skip", step=self.step, reason=reason, lr=lr, seq_len=seq_len)
            if self.skips >= tc.max_skips:
                raise TrainingDiverged(
                    f"training stopped at step {self.step}: {self.skips} consecutive steps skipped "
                    f"(max_skips={tc.max_skips}); last reason: {reason}. " + self._last_good() +
                    "; lower the lr or check the data")
            return rec
        # every gradient exactly 0 (an RL step whose groups are all degenerate): nothing to learn, and
        # Muon or Adam would still move the weights along the momentum of earlier steps
        stepped = grad_norm > 0.0
        if stepped:
            self.optimizer.step()
        clip = self.qk_clip.apply() if self.qk_clip is not None else {}
        stats = self.balancer.update()
        self.skips = 0
        dt = time.perf_counter() - t0
        decision = self.threads.after_step(dt, tokens) if self.threads else None
        if decision is not None:  # --threads auto tried another count (k3.threads)
            self.metrics.log("threads", step=self.step, **decision)
        cv = stats["load_cv"]
        return self.metrics.log(
            "train", step=self.step, loss=loss_sum, lr=lr, seq_len=seq_len,
            tokens=self.tokens_seen, tokens_per_s=tokens / dt, threads=threads, grad_norm=grad_norm,
            load_cv=sum(cv) / len(cv) if cv else None, load_cv_layers=cv,
            load_max_over_mean=max(stats["load_max_over_mean"]) if cv else None, **clip,
            **({} if stepped else {"no_update": "zero gradient"}),
            **({"dropped_slots": stats["dropped_slots"]} if "dropped_slots" in stats else {}))

    def _abandon_step(self, data_state: dict, rng: dict) -> None:
        """Drop a step interrupted between micro-batches: the state is as after the last step."""
        self.optimizer.zero_grad(set_to_none=True)
        self.balancer.begin_step()
        self.data.load_state_dict(data_state)
        set_rng_state(rng)

    def _last_good(self) -> str:
        if self.last_saved_step is None:
            return f"No checkpoint was written ({self.run_dir} holds none)"
        return f"The last checkpoint (step {self.last_saved_step}) is in {self.run_dir}"

    # --------------------------------------------------------------------------------- eval
    @torch.no_grad()
    def evaluate(self, max_batches: int = 0) -> dict[str, float] | None:
        """Validation loss (nats/token) and bits per byte over the first ``max_batches`` batches
        (0: the whole validation split), at the curriculum's longest sequence length; None when a
        stop signal arrived meanwhile (checked per batch), or for an objective's run (nothing to
        validate on: post-training is evaluated on held-out tasks) and a run on in-memory batches."""
        if self.objective is not None or self.batches is not None:
            return None
        self.model.eval()
        nats, ntok, nbytes = 0.0, 0, 0
        try:
            for batch in self._val_batches(max_batches):
                if self.stop_signal is not None:
                    return None
                x, y, *docs = self.parallel.eval_rows(batch, self.tc.batch_size)
                nats += self._loss(x, y, "sum", *docs).item()
                keep = y[y != IGNORE_INDEX]
                ntok += keep.numel()
                nbytes += int(self.token_bytes[keep].sum())
        finally:
            self.model.train()
        nats, ntok, nbytes = self.parallel.sum([nats, ntok, nbytes])
        ntok, nbytes = int(ntok), int(nbytes)
        if ntok == 0 and self.tc.sft_data is not None:
            return None  # no validation conversation (val_percent 0 or too few rows): nothing to report
        if ntok == 0:
            raise ValueError("the validation split is empty")
        return {"val_loss": nats / ntok, "val_bpb": nats / math.log(2) / max(nbytes, 1),
                "val_tokens": ntok, "val_bytes": nbytes}

    def log_eval(self, max_batches: int) -> dict[str, float] | None:
        v = self.evaluate(max_batches)
        if v is None:
            return None
        self.metrics.log("val", step=self.step, **v)
        return v

    # ---------------------------------------------------------------------------------- run
    def _handle_signal(self, signum, frame) -> None:
        if self.stop_signal is not None:
            raise KeyboardInterrupt
        if self.parallel.stops_at_step_boundary:
            self._pending_signal = signum   # acted on at the next step boundary, on every rank at once
        else:
            self.stop_signal = signum

    def train(self) -> TrainResult:
        """Train to ``tc.steps``; checkpoint on the interval, at the end and at SIGINT/SIGTERM."""
        tc = self.tc
        handlers = {}
        import threading
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                handlers[sig] = signal.signal(sig, self._handle_signal)
        prog = Progress(tc.steps, self.step, tc.log_interval, tty=self.tty, stream=self.progress_stream)
        losses: list[float | None] = []
        val = None
        try:
            while self.step < tc.steps:
                rec = self.train_step()
                if rec["kind"] == "stopped":
                    break
                for cb in self.on_step_end:
                    cb(self, rec)
                if rec["kind"] == "skip":
                    losses.append(None)
                    prog.write(f"step {self.step}: skipped ({rec['reason']})")
                    prog.update(self.step, None, 0.0)
                else:
                    losses.append(rec["loss"])
                    extra = f"lr {rec['lr']:.2e}  T {rec['seq_len']}"
                    if rec["load_cv"] is not None:
                        extra += f"  load cv {rec['load_cv']:.2f}  max/mean {rec['load_max_over_mean']:.2f}"
                    prog.update(self.step, rec["loss"], rec["tokens_per_s"], extra)
                if self.stop_signal is not None:
                    break
                if tc.eval_interval and self.step % tc.eval_interval == 0 and self.step < tc.steps:
                    v = self.log_eval(tc.eval_batches)
                    if v is not None:
                        prog.write(f"step {self.step}: val loss {v['val_loss']:.4f}  "
                                   f"val bpb {v['val_bpb']:.4f}")
                if tc.ckpt_interval and self.step % tc.ckpt_interval == 0 and self.step < tc.steps:
                    self.save()
            if self.stop_signal is None:
                val = self.log_eval(tc.final_eval_batches)
                if val is not None:
                    prog.write(f"step {self.step}: final val loss {val['val_loss']:.4f}  "
                               f"val bpb {val['val_bpb']:.4f} ({val['val_tokens']:,} tokens)")
            self.save()
        finally:
            prog.close()
            for sig, h in handlers.items():
                signal.signal(sig, h)
            self.lock.release()
        if tc.plot:
            try:
                plot_run(self.run_dir)
            except ValueError:
                pass  # nothing to plot yet (stopped before the first step)
        if self.stop_signal is not None:
            name = signal.Signals(self.stop_signal).name
            self.print(f"{name}: stopped at step {self.step}; checkpoint saved in {self.run_dir / 'checkpoint'}; "
                       f"continue with: k3 train --resume {self.run_dir}")
            return TrainResult(self.run_dir, self.step, "interrupted", losses, None)
        return TrainResult(self.run_dir, self.step, "done", losses, val)
