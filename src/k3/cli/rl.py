"""``k3 rl --from CKPT --tasks DIR|FAMILY:A:B [...] --out DIR`` and ``k3 rl --resume DIR``.

RL from hidden verifiers (``k3.rl.grpo``) on the one Trainer. ``--tasks`` is repeatable: a task
directory, a folder of them, or ``FAMILY:A:B`` (training seeds A..B-1 of a task family, generated
into ``OUT/tasks``; held-out seeds are refused: they are the evaluation's). Trainer flags (lr,
optimizer, seed, threads, checkpoint interval, ...) are ``k3 train``'s; the lr is constant by
default (no warmup or decay), and checkpoints are written every ``--ckpt-interval`` steps.
``--nproc N`` (or torchrun) runs the learner in N processes (the Trainer with its Distributed
parallelism: FSDP2 over the ranks), each sampling its share of a step's episodes and training its
share of the micro-batches.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from k3.errors import CheckpointError, ConfigError

__all__ = ["rl_main", "distill_main"]

_TRAINER_FLAGS = ("steps", "optimizer", "ns_dtype", "lr", "weight_decay", "warmup_frac", "decay_frac",
                  "min_lr_ratio", "grad_clip", "max_skips", "balance", "dtype", "ckpt_interval", "seed",
                  "threads", "device", "plot", "out")


def _parser(kind: str = "rl") -> argparse.ArgumentParser:
    from k3.cli.train import _TRAIN_FLAGS

    distill = kind == "distill"
    p = argparse.ArgumentParser(prog=f"k3 {kind}", description=(
        "multi-teacher on-policy distillation on tasks (SPEC §10)" if distill else
        "RL from hidden verifiers on tasks (SPEC §10)"))
    if distill:
        p.add_argument("--student", dest="init_from", metavar="CKPT", help="checkpoint (run dir, checkpoint or model dir) of the student")
        p.add_argument("--teachers", help="TOML: a table per DOMAIN/EFFORT tag with checkpoint = PATH")
        p.add_argument("--estimator", default="exact", help="exact (whole vocabulary; --top-k K) | sampled")
        p.add_argument("--top-k", type=int, default=None, help="exact: the student's K likeliest tokens + a tail bucket")
        p.add_argument("--forward-weight", type=float, default=0.0,
                       help="exact: train (1-w) x reverse KL + w x forward KL(teacher || student), w in [0, 1]")
        p.add_argument("--reward-weight", type=float, default=0.0,
                       help="add W x the k3 rl policy loss on the verifier's rewards (groups >= 2)")
    else:
        p.add_argument("--from", dest="init_from", metavar="CKPT", help="checkpoint (run dir, checkpoint or model dir) to start from")
    p.add_argument("--resume", metavar="RUN_DIR", help=f"continue the {kind} run in RUN_DIR from its checkpoint")
    p.add_argument("--overwrite", action="store_true", help="replace an earlier run's checkpoint in --out")
    p.add_argument("--tasks", action="append", default=None,
                   help="task dir, folder of tasks, or FAMILY:A:B (training seeds A..B-1); repeatable")
    p.add_argument("--group", type=int, default=4 if distill else 8,
                   help="episodes per task and step" + ("" if distill else " (>= 2)"))
    p.add_argument("--tasks-per-step", type=int, default=2)
    p.add_argument("--effort", action="append", default=None, help="low | high | max | all (cycled per group)")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--max-tokens", type=int, default=256, help="completion tokens per model call")
    p.add_argument("--context-tokens", type=int, default=4096)
    p.add_argument("--eps-low", type=float, default=0.2, help="clip range below 1")
    p.add_argument("--eps-high", type=float, default=0.2, help="clip range above 1")
    p.add_argument("--beta", type=float, default=0.0, help="k3 KL penalty toward the starting weights")
    p.add_argument("--scale-std", action="store_true", help="divide advantages by the group's std")
    p.add_argument("--micro-tokens", type=int, default=8192, help="padded tokens per micro-batch")
    p.add_argument("--no-randomize", dest="randomize", action="store_false",
                   help="the canonical harness for every episode (default: seeded randomization)")
    p.add_argument("--canonical", type=float, default=0.0, metavar="F",
                   help="with randomization: the fraction of groups sampled on the canonical harness (default 0)")
    p.add_argument("--backend", default="namespace", help="sandbox backend: namespace | vm")
    p.add_argument("--workers", type=int, default=1,
                   help="episodes at once (> 1: worker processes, each loading the step's weights)")
    p.add_argument("--ray", action="store_true", help="run the episodes as Ray tasks (RAY_ADDRESS: a cluster)")
    p.add_argument("--no-rollouts", dest="keep_rollouts", action="store_false",
                   help="do not keep each episode's trajectory under OUT/rollouts/")
    flags = {name: (flag, typ, hlp) for flag, name, typ, hlp in _TRAIN_FLAGS}
    for name in _TRAINER_FLAGS:
        flag, typ, hlp = flags[name]
        if typ is bool:
            p.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, default=None, help=hlp)
        else:
            p.add_argument(flag, dest=name, type=typ, default=None, help=hlp)
    p.add_argument("--nproc", type=int, metavar="N",
                   help="learn in N processes (torchrun; each samples its share of a step's episodes)")
    return p


def _rl_config(args):
    """The options of a fresh run; its tasks are resolved into the run dir once it is claimed."""
    from k3.rl.grpo import RLConfig

    distill = args.kind == "distill"
    efforts: list = ["all"] if distill else [None]
    if args.effort:
        efforts = args.effort
    efforts = [x for e in efforts for x in (["low", "high", "max"] if e == "all" else [e])]
    cls, extra = RLConfig, {}
    if distill:   # the distillation's options are RL's and its own
        from k3.rl.distill import DistillConfig, read_teachers
        if not args.teachers:
            raise ConfigError("--teachers FILE (the tag -> teacher table) is required")
        cls = DistillConfig
        extra = {"teachers": read_teachers(args.teachers), "estimator": args.estimator, "top_k": args.top_k,
                 "forward_weight": args.forward_weight, "reward_weight": args.reward_weight}
    return cls(tasks=list(args.tasks), group=args.group, tasks_per_step=args.tasks_per_step,
               efforts=efforts, temperature=args.temperature, max_tokens=args.max_tokens,
               context_tokens=args.context_tokens, eps_low=args.eps_low, eps_high=args.eps_high,
               beta=args.beta, scale_std=args.scale_std, micro_tokens=args.micro_tokens,
               randomize=args.randomize, canonical=args.canonical, backend=args.backend, workers=args.workers,
               ray=args.ray,
               seed=args.seed or 0,
               keep_rollouts=args.keep_rollouts, **extra).validate()


_RL_FLAGS = ("tasks", "effort", "beta", "scale_std", "micro_tokens", "randomize", "canonical", "backend",
             "keep_rollouts", "workers", "ray",
             "group", "tasks_per_step", "temperature", "max_tokens", "context_tokens", "eps_low", "eps_high")
_DISTILL_FLAGS = ("teachers", "estimator", "top_k", "forward_weight", "reward_weight")


def _train_config(args):
    from k3.train.config import TrainConfig
    from k3.checkpoint.training import find_checkpoint, load_trainer_state

    flags = {n: getattr(args, n) for n in _TRAINER_FLAGS if getattr(args, n) is not None}
    if args.resume:
        if args.overwrite:
            raise ConfigError("--overwrite starts a fresh run; it cannot be combined with --resume")
        if flags.get("out") not in (None, args.resume):
            raise ConfigError("--resume continues a run in place; do not pass a different --out")
        defaults = _parser(args.kind).parse_args([])
        changed = [n for n in _RL_FLAGS + (_DISTILL_FLAGS if args.kind == "distill" else ())
                   if getattr(args, n) != getattr(defaults, n)]
        if args.seed is not None:   # the episodes' seeds are the run's: a new one would not apply
            changed.append("seed")
        if args.init_from or changed:
            raise ConfigError("--resume takes the run's options from its checkpoint; only trainer flags "
                              f"(e.g. --steps) may change, got {', '.join(['from'] * bool(args.init_from) + changed)}")
        ckpt = find_checkpoint(args.resume)
        if ckpt is None:
            raise CheckpointError(f"nothing to resume: {args.resume} holds no checkpoint")
        base = load_trainer_state(ckpt)["train_config"]
        base.update(flags)
        base["out"] = args.resume
        tc = TrainConfig.from_dict(base, "options")
    else:
        if not args.init_from:
            raise ConfigError(("--student" if args.kind == "distill" else "--from")
                              + " CKPT (the checkpoint to start from) is required")
        if not args.tasks:
            raise ConfigError("--tasks DIR|FAMILY:A:B is required")
        base = {"init_from": args.init_from, "out": f"runs/{Path(args.init_from).resolve().name}-{args.kind}",
                "steps": 50, "lr": 3e-4, "warmup_frac": 0.0, "decay_frac": 0.0,
                "eval_interval": 0, "ckpt_interval": 10, "log_interval": 1}
        base.update(flags)
        tc = TrainConfig.from_dict(base, "options")
    tc.validate()
    return tc


def distill_main(argv: list[str] | None = None, trainer_hook=None) -> int:
    """``k3 distill --student CKPT --teachers teachers.toml --tasks ...`` (``k3.rl.distill``)."""
    return rl_main(argv, trainer_hook, kind="distill")


def rl_main(argv: list[str] | None = None, trainer_hook=None, kind: str = "rl") -> int:
    from k3.cliutil import guarded, sigterm_interrupts

    args = _parser(kind).parse_args(argv)
    args.kind = kind

    def launch() -> int:
        from k3.cli.train import launch_torchrun
        _train_config(args)   # bad options fail here, once, before any process starts
        if not args.resume:
            from k3.rl.grpo import resolve_tasks
            resolve_tasks(_rl_config(args).tasks, None)
        return launch_torchrun(args.nproc, argv, kind)

    def run() -> int:
        from k3.train.distributed import destroy
        try:
            return learn()
        finally:
            destroy()   # a distributed run's process group (also when setup failed)

    def learn() -> int:
        from k3.rl.distill import DistillObjective
        from k3.rl.grpo import GRPOObjective, resolve_tasks
        from k3.cli.train import make_trainer
        from k3.train.loop import TrainingDiverged

        tc = _train_config(args)
        rl = None
        if not args.resume:
            rl = _rl_config(args)
            resolve_tasks(rl.tasks, None)   # bad task values fail before the run dir is touched
        obj = (DistillObjective if kind == "distill" else GRPOObjective)(rl)
        trainer = make_trainer(tc, args.resume, args.overwrite, kind, objective=obj)
        try:
            obj.log = trainer.print
            if trainer_hook is not None:
                trainer_hook(trainer)
            trainer.print(f"k3 {kind}: {len(obj.rl.tasks)} tasks, groups of {obj.rl.group}, "
                          f"{obj.rl.tasks_per_step} tasks per step; run dir {tc.out}"
                          + (f"; resuming at step {trainer.step}" if args.resume else ""))
            if not args.resume:
                with sigterm_interrupts():   # the replay's sandboxes are closed below, not left running
                    obj.check_hacks(trainer)
            res = trainer.train()
        except TrainingDiverged as e:
            print(f"k3 {kind}: {e}", file=sys.stderr)
            return 1
        finally:
            trainer.close()
            obj.close()
        if res.status == "interrupted":
            from k3.cliutil import exit_quietly_on_signals
            exit_quietly_on_signals()
            return 128 + int(trainer.stop_signal)
        return 0

    return guarded(kind, launch if args.nproc is not None else run)
