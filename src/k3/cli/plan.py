"""``k3 plan``: per-device memory and per-step communication of a config on a cluster
(``k3.train.plan``, docs/PLAN.md)."""

from __future__ import annotations

import argparse
import json
import math

from k3.config import K3Config, get_preset
from k3.train.plan import DTYPES, checkpoint_summary, format_plan, inference_plan, parse_bytes, train_plan
from k3.train.plan_activations import ATTENTION_KINDS

__all__ = ["build_parser", "plan_main"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="k3 plan", description="per-device memory and communication on a cluster")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--preset", default="k3", help="preset name (default k3)")
    g.add_argument("--config", help="path to a config.json (or a checkpoint directory)")
    p.add_argument("--devices", type=int, required=True)
    p.add_argument("--device-memory", required=True, help="memory of one device, e.g. 141GB or 80GiB")
    p.add_argument("--dp", type=int, default=None, help="data-parallel (FSDP) size (default devices/ep)")
    p.add_argument("--ep", type=int, default=1, help="expert-parallel size")
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--context", type=int, default=131072, help="inference context per sequence")
    p.add_argument("--infer-ep", type=int, default=None,
                   help="expert-parallel size for inference (default gcd(devices, num_experts))")
    p.add_argument("--recompute", action="store_true", help="per-decoder-layer activation recomputation")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="compute/communication dtype")
    p.add_argument("--attention", choices=ATTENTION_KINDS, default="fused",
                   help="MLA attention kernel: fused (CUDA memory-efficient SDPA: inputs + log-sum-exp "
                        "saved) or math (CPU: fp32 copies and the T×T probabilities saved)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def plan_main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    cfg = K3Config.from_json(args.config) if args.config else get_preset(args.preset)
    mem = parse_bytes(args.device_memory)
    dp = args.dp if args.dp is not None else max(1, args.devices // max(1, args.ep))
    dtype = DTYPES[args.dtype]
    tp = train_plan(cfg, args.devices, mem, dp, args.ep, args.seq_len, args.micro_batch, args.grad_accum,
                    args.recompute, dtype, args.attention)
    infer_ep = args.infer_ep if args.infer_ep is not None else math.gcd(args.devices, cfg.num_experts or 1)
    ip = inference_plan(cfg, args.devices, mem, infer_ep, args.context, dtype)
    ck = checkpoint_summary(cfg)
    if args.json:
        print(json.dumps({"train": tp, "inference": ip, "checkpoint": ck}))
    else:
        print(format_plan(args.config or args.preset, tp, ip, ck))
    return 0
