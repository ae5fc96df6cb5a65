"""The ``k3`` command: ``k3 params | train | sample | generate | chat | plot | convert | inspect |
quantize | demo | plan | env | task | sft | rl | distill | eval``."""

from __future__ import annotations

import argparse
import json
import sys

__all__ = ["main"]


def _config_from_args(args):
    from k3.config import K3Config, get_preset

    if getattr(args, "config", None):
        return K3Config.from_json(args.config)
    return get_preset(args.preset)


def cmd_params(args) -> int:
    from k3.errors import ConfigError
    from k3.model.summary import build_meta_model, build_meta_vision, format_breakdown, parameter_breakdown

    cfg = _config_from_args(args)
    model = build_meta_model(cfg)
    try:
        vision = build_meta_vision(cfg)
    except ConfigError as e:  # another tower's vision_config (Kimi-VL, K2.5): count the text model
        print(f"vision_config not counted: {e}", file=sys.stderr)
        vision = None
    b = parameter_breakdown(model, vision)
    name = args.config or args.preset
    if args.json:
        print(json.dumps(b.as_dict()))
    else:
        print(format_breakdown(b, f"K3 parameters ({name}; {cfg.num_hidden_layers} layers, "
                                  f"{len(cfg.kda_layer_ids)} KDA + {len(cfg.mla_layer_ids)} MLA, "
                                  f"{cfg.num_experts} experts top-{cfg.num_experts_per_token})"))
        if args.mxfp4:
            print(mxfp4_note(b, cfg))
    return 0


def mxfp4_note(b, cfg) -> str:
    """Checkpoint bytes with routed experts packed as MXFP4 and the rest as released (bf16, fp32 few)."""
    from k3.model.summary import MXFP4_BITS
    from k3.train.plan import checkpoint_summary

    ck = checkpoint_summary(cfg)
    total = ck["text"]
    lines = [f"MXFP4 routed experts: {MXFP4_BITS} bits per parameter (4-bit E2M1 + one E8M0 scale per 32), "
             f"{b.routed_experts:,} parameters -> {b.routed_experts * MXFP4_BITS / 8 / 2**30:,.1f} GiB",
             f"packed text checkpoint: {total:,.0f} bytes = {total / 2**30:,.1f} GiB ({total / 1e12:.2f} TB); "
             "other tensors bf16, conv/A_log/dt_bias/o_norm/router bias fp32"]
    if "release_gib" in ck:
        lines.append(f"release: {ck['release_gib']:,} GiB in {ck['release_shards']} shards = text + the vision "
                     f"tower and projector of the release's vision_config ({ck['vision']:,} bytes bf16): "
                     f"{ck['total'] / 2**30:,.2f} GiB")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="k3", description="K3: Kimi K3 architecture in PyTorch")
    sub = p.add_subparsers(dest="cmd", required=True)

    sp = sub.add_parser("params", help="parameter breakdown of a config (built on the meta device)")
    g = sp.add_mutually_exclusive_group()
    g.add_argument("--preset", default="k3", help="preset name (default k3)")
    g.add_argument("--config", help="path to a config.json (or a checkpoint directory)")
    sp.add_argument("--json", action="store_true", help="print one JSON object")
    sp.add_argument("--mxfp4", action="store_true",
                    help="also state the MXFP4 routed-expert storage (4.25 bits per parameter)")
    sp.set_defaults(func=cmd_params)

    # Subcommands with their own argparse parsers: the rest of argv is passed through.
    for name, target, help_ in _DELEGATED:
        dp = sub.add_parser(name, help=help_, add_help=False)
        dp.set_defaults(delegate=target)
    return p


_DELEGATED = [
    ("train", "k3.cli.train:train_main", "train a K3 model (k3 train --preset tiny --out runs/tiny)"),
    ("sft", "k3.cli.train:sft_main", "fine-tune on conversations / passing trajectories (k3 sft --from RUN --data F)"),
    ("rl", "k3.cli.rl:rl_main", "RL from hidden verifiers on tasks (k3 rl --from RUN --tasks files:0:16)"),
    ("distill", "k3.cli.rl:distill_main",
     "on-policy distillation from teachers per domain/effort (k3 distill --student RUN --teachers T.toml --tasks ...)"),
    ("eval", "k3.cli.eval:eval_main",
     "evaluate with the conditions recorded: k3 eval bpb|agent|harness|accept|retrieve|compare|report"),
    ("sample", "k3.cli.infer:sample_main", "sample from a trained run (k3 sample runs/tiny --prompt ...)"),
    ("generate", "k3.cli.infer:generate_main", "continue a prompt, streaming (k3 generate CKPT --prompt ...)"),
    ("chat", "k3.cli.infer:chat_main", "chat with a model in the terminal (k3 chat CKPT --show-thinking)"),
    ("serve", "k3.cli.serve:serve_main", "OpenAI-compatible HTTP server (k3 serve CKPT --port 8000)"),
    ("plot", "k3.cli.train:plot_main", "plot a run's losses and expert load (PNG)"),
    ("demo", "k3.cli.train:demo_main", "the main job: train tiny on the stdlib, report bits/byte, sample"),
    ("agent-demo", "k3.cli.agent_demo:agent_demo_main", "SFT the demo model on task families, evaluate it on held-out tasks"),
    ("vision-demo", "k3.cli.vision_demo:vision_demo_main",
     "SFT a tiny model with a vision tower on synthetic image questions, against a text-only control"),
    ("convert", "k3.cli.checkpoint:convert_main", "re-export a checkpoint in k3's layout"),
    ("inspect", "k3.cli.checkpoint:inspect_main", "summarise a checkpoint without materialising it"),
    ("quantize", "k3.cli.checkpoint:quantize_main", "write routed experts as packed MXFP4"),
    ("plan", "k3.cli.plan:plan_main", "per-device memory and communication of a preset on a cluster"),
    ("env", "k3.cli.env:env_main", "sandboxes: k3 env create | exec | snapshot | fork | restore | ls | rm"),
    ("task", "k3.cli.task:task_main", "agent tasks: k3 task validate | run | suite | replay | gen | synth"),
]


def _run_delegate(target: str, argv: list[str]) -> int:
    import importlib

    mod, fn = target.split(":")
    return getattr(importlib.import_module(mod), fn)(argv) or 0


def main(argv: list[str] | None = None) -> int:
    from k3.cliutil import guarded, leave_now_if_stopping, pop_debug_flag

    argv = pop_debug_flag(sys.argv[1:] if argv is None else list(argv))
    args, rest = build_parser().parse_known_args(argv)
    if getattr(args, "delegate", None):
        code = guarded(args.cmd, lambda: _run_delegate(args.delegate, rest))
        leave_now_if_stopping(code)  # stopped by a signal: exit before finalization (see cliutil)
        return code
    if rest:
        build_parser().error(f"unrecognized arguments: {' '.join(rest)}")
    import torch
    torch.set_flush_denormal(True)  # an entry point's choice, never an import side effect (ops/kda.py)
    return guarded(args.cmd, lambda: args.func(args))


if __name__ == "__main__":
    sys.exit(main())
