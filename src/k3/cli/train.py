"""``k3 train | sft | plot | demo``: argument parsing and the glue around the Trainer (``k3 sample``
lives in ``k3.cli.infer``, ``load_run_model`` in ``k3.infer.run_model``).

Each ``*_main(argv)`` parses its own arguments and returns an exit status: 0 done, 2 bad input
(message on stderr), 1 training diverged, 128 + signal number when stopped by SIGINT/SIGTERM
(after writing a checkpoint).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Callable

from k3.rl.sft import SFTRows

__all__ = ["train_main", "plot_main", "demo_main", "sft_main"]


def _threads_flag(value: str):
    """``--threads auto|N`` for argparse (a bad value: "argument --threads: ...", exit 2)."""
    from k3.threads import parse_threads
    try:
        return parse_threads(value, "--threads")
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


# flag -> (TrainConfig field, type, help); booleans become --x / --no-x
_TRAIN_FLAGS: list[tuple[str, str, Any, str]] = [
    ("--preset", "preset", str, "model preset (nano, tiny, small, ...)"),
    ("--model-config", "model_config", str, "model config.json (or checkpoint dir); overrides --preset"),
    ("--data", "data", str, "local text/JSONL files or a HF datasets dir (default: Python stdlib)"),
    ("--val-percent", "val_percent", int, "percent of documents held out for validation"),
    ("--out", "out", str, "run directory (checkpoints, metrics, plot)"),
    ("--steps", "steps", int, "optimizer steps"),
    ("--batch-size", "batch_size", int, "sequences per micro-batch"),
    ("--grad-accum", "grad_accum", int, "micro-batches per optimizer step"),
    ("--optimizer", "optimizer", str, "per_head | muon | adamw"),
    ("--ns-dtype", "ns_dtype", str, "bf16 | fp32: Muon's Newton-Schulz iteration (default bf16)"),
    ("--lr", "lr", float, "peak learning rate"),
    ("--weight-decay", "weight_decay", float, "decoupled weight decay"),
    ("--warmup-frac", "warmup_frac", float, "WSD warmup, fraction of steps"),
    ("--decay-frac", "decay_frac", float, "WSD decay, fraction of steps"),
    ("--min-lr-ratio", "min_lr_ratio", float, "lr floor at the end of the decay, x peak"),
    ("--grad-clip", "grad_clip", float, "clip the global grad norm (0: off)"),
    ("--max-skips", "max_skips", int, "stop after this many consecutive non-finite steps"),
    ("--balance", "balance", str, "router balancing: quantile | sign | off"),
    ("--balance-rate", "balance_rate", float, "step size of --balance sign"),
    ("--qat", "qat", bool, "MXFP4 quantization-aware training of the routed experts"),
    ("--qk-clip", "qk_clip", float, "QK-Clip: cap each MLA head's max attention logit at TAU"),
    ("--dtype", "dtype", str, "fp32 | bf16 (bf16 autocast; fp32 master weights and KDA state)"),
    ("--compile-attn-res", "compile_attn_res", bool, "torch.compile the AttnRes mixing (opt-in: ~1.14x "
     "on tiny, compile time on the first steps; rounding differs from eager)"),
    ("--attn-res", "attn_res", bool, "Block Attention Residuals (--no-attn-res: standard residuals)"),
    ("--hidden-act", "hidden_act", str, "situ | silu"),
    ("--capacity-factor", "capacity_factor", float, "MoE expert capacity factor (default: dropless)"),
    ("--qb-bins", "qb_bins", int, "histogram Quantile Balancing bins (default: exact; 1024 distributed)"),
    ("--dp", "dp", int, "data-parallel degree under torchrun (default: world size / ep)"),
    ("--ep", "ep", int, "expert-parallel degree under torchrun (each rank holds num_experts/ep)"),
    ("--log-interval", "log_interval", int, "steps between log lines (non-terminal output)"),
    ("--eval-interval", "eval_interval", int, "steps between validation evals (0: only at the end)"),
    ("--eval-batches", "eval_batches", int, "validation batches per eval (0: whole split)"),
    ("--final-eval-batches", "final_eval_batches", int, "validation batches at the end (0: whole split)"),
    ("--ckpt-interval", "ckpt_interval", int, "steps between checkpoints (0: only at the end)"),
    ("--seed", "seed", int, "random seed"),
    ("--threads", "threads", _threads_flag, "torch CPU threads: auto (default: from the "
     "cores free, re-measured while training) | N | 0 (torch's default)"),
    ("--device", "device", str, "cpu | cuda"),
    ("--plot", "plot", bool, "write loss.png at the end"),
]
# fields of the model / corpus a fine-tuning run takes from its checkpoint (k3 sft has no such flag)
_PRETRAIN_ONLY = {"preset", "model_config", "data", "attn_res", "hidden_act"}
# k3 sft's own flags
_SFT_FLAGS: list[tuple[str, str, Any, str]] = [
    ("--from", "init_from", str, "run directory, checkpoint folder or model dir (with tokenizer.json) to start from"),
    ("--data", "sft_data", str, "chat JSONL file or directory (conversations and k3 task trajectories)"),
    ("--skip-bad", "skip_bad", bool, "count and report bad rows instead of stopping at the first"),
    ("--include-failed", "include_failed", bool, "also train on trajectories whose verdict did not pass"),
    ("--vision", "vision", str, "add a new vision tower of this preset (nano | tiny | small) to a text "
     "checkpoint: its data may hold images"),
    ("--freeze-vision", "freeze_vision", bool, "keep the vision tower's weights fixed (the projector trains)"),
]


def _run_guarded(cmd: str, fn: Callable[[], int]) -> int:
    from k3.cliutil import guarded
    return guarded(cmd, fn)


# ------------------------------------------------------------------------------------- train
def build_train_parser(sft: bool = False) -> argparse.ArgumentParser:
    """``k3 train``'s flags; ``sft``: ``k3 sft``'s (the same trainer: --from and --data instead of
    the model and corpus flags, one sequence length)."""
    if sft:
        p = argparse.ArgumentParser(prog="k3 sft", description="Supervised fine-tuning on conversations "
                                    "(SPEC §10): the k3 train trainer, loss on the assistant's tokens only.")
    else:
        p = argparse.ArgumentParser(prog="k3 train", description="Train a K3 model (SPEC §5).")
    p.add_argument("--config", help="run.toml holding any of the options below (flags override it)")
    p.add_argument("--resume", metavar="RUN_DIR", help="continue the run in RUN_DIR from its checkpoint")
    p.add_argument("--overwrite", action="store_true",
                   help="replace the checkpoint (and metrics) of an earlier run in --out")
    p.add_argument("--nproc", type=int, metavar="N",
                   help="launch N processes on this machine with torchrun (torch.distributed.run)")
    p.add_argument("--seq-len", type=int, help="one fixed sequence length (instead of --curriculum)")
    if not sft:
        p.add_argument("--curriculum", help="context-length stages START:SEQ_LEN,... (START a step, or a "
                                            "fraction of the run when it has a dot), e.g. 0:256,0.4:512")
    flags = [f for f in _TRAIN_FLAGS if f[1] not in _PRETRAIN_ONLY] + _SFT_FLAGS if sft else _TRAIN_FLAGS
    for flag, name, typ, hlp in flags:
        if typ is bool:
            p.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, default=None, help=hlp)
        else:
            p.add_argument(flag, dest=name, type=typ, default=None, help=hlp)
    return p


def train_config_from_args(args: argparse.Namespace):
    """TrainConfig from parsed flags: (checkpoint's config when resuming) < run.toml < flags."""
    from k3.errors import CheckpointError, ConfigError
    from k3.train.config import TrainConfig, load_toml, parse_curriculum
    from k3.checkpoint.training import find_checkpoint, load_trainer_state

    flags = {name: getattr(args, name, None) for _, name, _, _ in _TRAIN_FLAGS + _SFT_FLAGS}
    curriculum = getattr(args, "curriculum", None)
    if args.seq_len is not None and curriculum is not None:
        raise ConfigError("pass either --seq-len or --curriculum, not both")
    if args.seq_len is not None:
        flags["curriculum"] = [[0, args.seq_len]]
    elif curriculum is not None:
        flags["curriculum"] = parse_curriculum(curriculum)
    if not args.resume:
        tc = TrainConfig.build(args.config, flags)
        if flags.get("out") is None and "out" not in (load_toml(args.config) if args.config else {}):
            tc = tc.replace(out=default_out(tc))
        return tc
    if args.overwrite:
        raise ConfigError("--overwrite starts a fresh run; it cannot be combined with --resume")
    if flags.get("out") not in (None, args.resume):
        raise ConfigError("--resume continues a run in place; do not pass a different --out")
    ckpt = find_checkpoint(args.resume)
    if ckpt is None:
        raise CheckpointError(f"nothing to resume: {args.resume} holds no checkpoint")
    base = load_trainer_state(ckpt)["train_config"]
    if args.config:
        base.update(load_toml(args.config))
    base.update({k: v for k, v in flags.items() if v is not None})
    base["out"] = args.resume
    tc = TrainConfig.from_dict(base, args.config or "options")
    tc.validate()
    return tc


def default_out(tc) -> str:
    """``runs/<name>`` of what is trained: the preset, or the model config's name (its folder's
    name for a ``config.json`` or a checkpoint directory); ``runs/<from>-sft`` for fine-tuning."""
    if tc.init_from:
        return f"runs/{Path(tc.init_from).resolve().name or 'model'}-sft"
    if not tc.model_config:
        return f"runs/{tc.preset}"
    p = Path(tc.model_config)
    name = p.name if p.is_dir() or p.suffix != ".json" else (p.parent.name if p.stem == "config" else p.stem)
    return f"runs/{name or 'model'}"


def train_main(argv: list[str] | None = None, trainer_hook: Callable | None = None, *,
               sft: bool = False, read_rows: Callable | None = None) -> int:
    """``k3 train`` (``sft``: ``k3 sft``, reading rows with ``read_rows``). ``trainer_hook(trainer)``
    runs before training (tests attach callbacks)."""
    cmd = "sft" if sft else "train"
    args = build_train_parser(sft).parse_args(argv)
    args.read_rows, args.command = read_rows, cmd
    if sft and not args.resume and not args.init_from:
        return _run_guarded(cmd, _missing("--from CKPT (the checkpoint to fine-tune) is required"))
    if sft and not args.resume and not args.sft_data:
        return _run_guarded(cmd, _missing("--data FILE_OR_DIR (the conversations) is required"))
    if args.nproc is not None:
        return _run_guarded(cmd, lambda: launch_torchrun(args.nproc, argv, cmd))

    def run() -> int:
        from contextlib import nullcontext

        from k3.checkpoint.rundir import RunLock
        import os
        # under torchrun only rank 0 locks the run dir (the others read while it holds the lock)
        held = args.resume and Path(args.resume).is_dir() and os.environ.get("RANK", "0") == "0"
        with RunLock(args.resume) if held else nullcontext():  # no one saves while we read
            return _train(args, trainer_hook)

    return _run_guarded(cmd, run)


def _missing(message: str) -> Callable[[], int]:
    def fail() -> int:
        from k3.errors import ConfigError
        raise ConfigError(message)
    return fail


def launch_torchrun(nproc: int, argv: list[str] | None, command: str = "train") -> int:
    """``k3 train --nproc N ...``: run ``torchrun --standalone --nproc-per-node N -m k3 train ...``
    (a free rendezvous port on localhost) and return its exit status."""
    import os
    import subprocess

    from k3.errors import ConfigError
    if nproc < 1:
        raise ConfigError(f"--nproc must be > 0, got {nproc}")
    rest, skip = [], False
    for a in (sys.argv[1:] if argv is None else argv):
        if skip:
            skip = False
        elif a == "--nproc":
            skip = True
        elif not a.startswith("--nproc="):
            rest.append(a)
    env = {**os.environ}
    env.setdefault("OMP_NUM_THREADS", "1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "k3", command, *rest]
    return subprocess.run(cmd, env=env).returncode


def make_trainer(tc, resume: str | None, overwrite: bool, command: str = "train", **extra):
    """The Trainer (``resume``: the run dir, or None for a fresh run); it runs in one process, or
    distributed under torchrun / for a DCP checkpoint (its parallelism object); dp·ep > 1 without
    torchrun is refused."""
    from k3.errors import ConfigError
    from k3.train.distributed import is_distributed_launch
    from k3.train.loop import Trainer
    if not is_distributed_launch() and (tc.dp or 1) * tc.ep > 1:
        raise ConfigError(f"dp × ep = {(tc.dp or 1) * tc.ep} processes: launch with "
                          f"k3 {command} --nproc {(tc.dp or 1) * tc.ep} ... or torchrun")
    return Trainer(tc, resume=bool(resume), overwrite=overwrite, **extra)


def _make_trainer(tc, args: argparse.Namespace):
    extra = {"read_rows": args.read_rows} if getattr(args, "read_rows", None) else {}
    return make_trainer(tc, args.resume, args.overwrite, args.command, **extra)


def _train(args: argparse.Namespace, trainer_hook: Callable | None) -> int:
    from k3.train.distributed import destroy
    try:
        return _train_in_group(args, trainer_hook)
    finally:
        destroy()  # a distributed run's process group (also when setup failed)


def _train_in_group(args: argparse.Namespace, trainer_hook: Callable | None) -> int:
    from k3.train.loop import TrainingDiverged
    tc = train_config_from_args(args)
    trainer = _make_trainer(tc, args)
    if trainer_hook is not None:
        trainer_hook(trainer)
    if trainer.rank == 0:
        print(f"{trainer.corpus.summary()}\nmodel: {tc.init_from or tc.model_config or tc.preset}, "
              f"{trainer.param_count():,} parameters; run dir {tc.out}"
              + (f"; resuming at step {trainer.step}" if args.resume else ""), flush=True)
    try:
        res = trainer.train()
    except TrainingDiverged as e:
        print(f"k3 {getattr(args, 'command', 'train')}: {e}", file=sys.stderr)
        return 1
    if res.status == "interrupted":
        from k3.cliutil import exit_quietly_on_signals
        exit_quietly_on_signals()
        return 128 + int(trainer.stop_signal)
    return 0


# -------------------------------------------------------------------------------------- plot
def plot_main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="k3 plot", description="Plot a run's loss, bits per byte and load CV.")
    p.add_argument("run", help="run directory (holds metrics.jsonl)")
    p.add_argument("--out", help="PNG path (default RUN/loss.png)")
    args = p.parse_args(argv)

    def run() -> int:
        from k3.train.metrics import plot_run
        print(plot_run(args.run, args.out))
        return 0

    return _run_guarded("plot", run)


# -------------------------------------------------------------------------------------- demo
DEMO_PROMPTS = ("def fib(n):", "import os\n\n\ndef ", "class Stack:\n    def __init__(self):")


def compressed_bits_per_byte(texts) -> dict[str, float]:
    """The concatenated texts compressed by gzip -9, bzip2 -9 and xz -9e (Python's gzip, bz2 and lzma
    at those settings), each in bits per input byte: the baselines the demo's bits per byte are read
    against."""
    import bz2
    import gzip
    import lzma

    data = "".join(texts).encode("utf-8")
    n = max(len(data), 1)
    return {"gzip -9": 8 * len(gzip.compress(data, 9)) / n, "bzip2 -9": 8 * len(bz2.compress(data, 9)) / n,
            "xz -9e": 8 * len(lzma.compress(data, preset=9 | lzma.PRESET_EXTREME)) / n}


def demo_main(argv: list[str] | None = None, recipe: tuple[dict, int] | None = None) -> int:
    """``k3 demo``; ``recipe``: (config, default steps) in place of (DEMO_CONFIG, DEMO_STEPS), as the
    agent demo pretrains its base (AGENT_BASE_CONFIG) through the same code."""
    config, steps = recipe or (DEMO_CONFIG, DEMO_STEPS)
    n = config["model_overrides"]["num_hidden_layers"]
    w = config["model_overrides"].get("hidden_size")
    p = argparse.ArgumentParser(prog="k3 demo", description=f"Train a {n}-layer K3 (the {config['preset']} "
                                f"preset, cut to {n} layers{f' of width {w}' if w else ''}) on the Python stdlib, "
                                "then print validation bits per byte and samples.")
    p.add_argument("--out", default="runs/demo")
    p.add_argument("--steps", type=int, default=steps)
    p.add_argument("--threads", type=_threads_flag, default="auto", help="auto | N (see k3 train)")
    p.add_argument("--samples-tokens", type=int, default=120)
    args = p.parse_args(argv)

    def run() -> int:
        from k3.train.config import TrainConfig
        from k3.checkpoint.rundir import RunLock, check_foreign_dir, claim_run_dir

        out = Path(args.out)
        tc = TrainConfig.build(overrides={**config, "out": str(out), "steps": args.steps,
                                          "threads": args.threads})
        check_foreign_dir(out)
        out.mkdir(parents=True, exist_ok=True)
        with RunLock(out):  # the next k3 demo replaces a folder an earlier k3 demo created
            claim_run_dir(out, "k3 demo", replace_same_kind=True)
            return _demo(tc, out, args)

    return _run_guarded("demo", run)


def _demo(tc, out: Path, args: argparse.Namespace) -> int:
    import json
    import time

    import torch

    from k3.data.tokenizer import EOS_TOKEN
    from k3.infer.generate import generate
    from k3.train.loop import Trainer

    t0 = time.perf_counter()
    trainer = Trainer(tc)
    setup_s = time.perf_counter() - t0
    cfg = trainer.model_config
    print(f"{trainer.corpus.summary()}\n{tc.preset} preset at {cfg.num_hidden_layers} layers "
          f"({len(cfg.linear_attn_config.kda_layers)} KDA + {len(cfg.linear_attn_config.full_attn_layers)} MLA): "
          f"{sum(p.numel() for p in trainer.model.parameters()):,} parameters, "
          f"{tc.steps} steps of {tc.batch_size} sequences, curriculum {tc.curriculum}", flush=True)
    res = trainer.train()
    if res.status != "done":
        from k3.cliutil import exit_quietly_on_signals
        exit_quietly_on_signals()
        return 128 + int(trainer.stop_signal)
    dt = time.perf_counter() - t0
    train_s = dt - setup_s
    # The plotted evaluations all score the same first batches; the reported figure is the
    # whole validation split, next to the compressors on exactly that text.
    full = trainer.evaluate(0)
    seen = [int(i) for i in trainer.val_tokens]
    comp = compressed_bits_per_byte([trainer.tokenizer.decode(seen).replace(EOS_TOKEN, "")])
    train_recs = [r for r in trainer.metrics.records if r["kind"] == "train"]
    tps = sum(r["tokens_per_s"] for r in train_recs) / max(len(train_recs), 1)
    print(f"\nvalidation, whole split: {full['val_bpb']:.3f} bits per byte ({full['val_loss']:.3f} nats/token "
          f"over {full['val_tokens']:,} tokens, {full['val_bytes']:,} bytes); on the same text: "
          + ", ".join(f"{name} {v:.3f}" for name, v in comp.items()) + " bits per byte")
    print(f"(plotted evaluations, first {res.val['val_tokens']:,} tokens: {res.val['val_bpb']:.3f} bits per byte)")
    print(f"training time {dt / 60:.1f} min, {tps:,.0f} training tokens/s; plot: {out / 'loss.png'}")
    model, tok = trainer.model, trainer.tokenizer
    for i, prompt in enumerate(DEMO_PROMPTS):
        ids = generate(model, torch.tensor(tok.encode(prompt)), args.samples_tokens, temperature=0.7,
                       top_k=50, seed=i, eos=tok.eos_token_id)
        text = tok.decode(ids.tolist()).replace(EOS_TOKEN, "")
        print(f"\n--- sample {i + 1} " + "-" * 50 + f"\n{text}")
    report = demo_report(trainer, full=full, plotted=res.val, compressors=comp,
                         times={"setup_s": setup_s, "train_s": train_s, "total_s": time.perf_counter() - t0})
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nreport: {out / 'report.json'}")
    print(f"continue sampling with: k3 sample {out} --prompt 'def '")
    return 0


DEMO_LOAD_CV_WINDOWS = ((21, 60), (61, 120), (301, None))  # steps (inclusive; None: the last step)


def load_cv_windows(train_recs: list[dict], windows=DEMO_LOAD_CV_WINDOWS) -> list[dict]:
    """The mean expert-load CV (``load_cv`` of the train records) over each window of steps that
    holds records: [{"first", "last", "mean", "records"}]."""
    out = []
    for first, last in windows:
        last = last if last is not None else max((r["step"] for r in train_recs), default=0)
        cv = [r["load_cv"] for r in train_recs if first <= r["step"] <= last and r.get("load_cv") is not None]
        if cv:
            out.append({"first": first, "last": last, "mean": sum(cv) / len(cv), "records": len(cv)})
    return out


def demo_report(trainer, *, full: dict, plotted: dict | None, compressors: dict, times: dict) -> dict:
    """What ``k3 demo`` measured, with its machine and date: the figures of the README's demo table
    (``benchmarks/docs_tables.py --save-demo OUT/report.json``). ``times``: ``setup_s`` (corpus,
    tokenizer, token cache and model: the first run trains the tokenizer and fills the cache),
    ``train_s`` (the training steps with their periodic evaluations and checkpoints) and ``total_s``
    (all of it, the whole-split evaluation and the samples included). ``threads``: the setting
    (``auto`` may change the count between steps), ``threads_used``: the counts the steps ran with."""
    import platform
    import time

    from k3.rl.eval_rows import machine

    tc, cfg, c = trainer.tc, trainer.model_config, trainer.corpus
    train_recs = [r for r in trainer.metrics.records if r["kind"] == "train"]
    tps = sum(r["tokens_per_s"] for r in train_recs) / max(len(train_recs), 1)
    return {
        "machine": machine(), "date": time.strftime("%Y-%m-%d"), "python": platform.python_version(),
        "threads": tc.threads, "threads_used": sorted({r["threads"] for r in train_recs if r.get("threads")}),
        "corpus": {"name": c.name, "train_files": c.num_documents("train"), "train_bytes": c.train_bytes,
                   "validation_files": c.num_documents("validation"), "validation_bytes": c.val_bytes},
        "model": {"preset": tc.preset, "layers": cfg.num_hidden_layers, "hidden_size": cfg.hidden_size,
                  "kda_layers": len(cfg.linear_attn_config.kda_layers),
                  "mla_layers": len(cfg.linear_attn_config.full_attn_layers),
                  "params": sum(p.numel() for p in trainer.model.parameters())},
        "steps": tc.steps, "batch_size": tc.batch_size, "seq_len": max(n for _, n in tc.curriculum),
        "validation": {k: full[k] for k in ("val_bpb", "val_loss", "val_tokens", "val_bytes")},
        "compressors": compressors,
        "plotted": None if plotted is None else {k: plotted[k] for k in ("val_bpb", "val_tokens")},
        "train_tokens_per_s": tps,
        "load_cv": load_cv_windows(train_recs),
        "times": {k: round(v, 1) for k, v in times.items()},
    }


# The demo's recipe (issue 15 sweep: benchmarks/recipe.py, docs/RECIPE.md; issue 36: benchmarks/scaling.py,
# docs/SCALING.md). At a fixed 10-minute budget on 2 cores the model sees a few million tokens, far below
# one token per parameter, where the loss is set by the tokens seen more than by depth or width: at equal
# wall time a smaller K3 that sees more tokens wins. So: the tiny preset at 2 layers (KDA then Gated MLA,
# the presets' layout rule at n = 2; AttnRes blocks of 1) and width 128 (2 heads of 64; every width-tied
# size of tiny halved, as benchmarks/scaling.py k3_shape scales it; LatentMoE 16 experts top-4 + 1 shared
# with QB; SiTU; Per-Head Muon), 16 sequences of 256 tokens per step, lr 1e-2 (the sweep's lr scan), WSD
# with the decay over the last 70% of the steps, 1,200 steps (4,915,200 tokens). What it reaches and how
# long it takes: README (generated from docs/data/demo.json, the report of one run).
DEMO_STEPS = 1200
DEMO_CONFIG: dict[str, Any] = {
    "preset": "tiny",
    "model_overrides": {
        "hidden_size": 128, "num_hidden_layers": 2, "attn_res_block_size": 1, "num_attention_heads": 2,
        "q_lora_rank": 64, "kv_lora_rank": 32, "intermediate_size": 384, "moe_intermediate_size": 64,
        "routed_expert_hidden_size": 64,
        "linear_attn_config": {"kda_layers": [1], "full_attn_layers": [2], "num_heads": 2,
                               "head_dim": 64, "short_conv_kernel_size": 4, "gate_lower_bound": -5.0,
                               "use_full_rank_gate": True},
    },
    "batch_size": 16, "curriculum": [[0, 256]], "lr": 1e-2, "warmup_frac": 0.1, "decay_frac": 0.7,
    "eval_interval": 100, "eval_batches": 4, "final_eval_batches": 4, "ckpt_interval": 200, "log_interval": 10,
}


# The agent demo's base (k3 agent-demo, docs/POSTTRAINING.md): the demo's recipe before issue 36 (width 256,
# lr 5e-3, 560 steps, 4.2M parameters). Fine-tuning wants the larger model, not the text demo's 10-minute
# optimum, and the recorded agent, RL and distillation figures were measured on it.
AGENT_BASE_STEPS = 560
AGENT_BASE_CONFIG: dict[str, Any] = {
    **DEMO_CONFIG, "lr": 5e-3, "eval_interval": 50, "ckpt_interval": 100,
    "model_overrides": {"num_hidden_layers": 2, "attn_res_block_size": 1,
                        "linear_attn_config": {**DEMO_CONFIG["model_overrides"]["linear_attn_config"], "num_heads": 4}},
}


def sft_main(argv: list[str] | None = None, trainer_hook=None) -> int:
    """``k3 sft --from CKPT --data FILE_OR_DIR [--qat] [--out DIR] [flags of k3 train]``."""
    rows = SFTRows()

    def hook(trainer) -> None:
        if rows.failed:
            trainer.print(f"left out {len(rows.failed)} trajectories whose verdict did not pass "
                          f"(--include-failed trains on them), e.g. {rows.failed[0]}")
        if trainer_hook is not None:
            trainer_hook(trainer)
    return train_main(argv, hook, sft=True, read_rows=rows)
