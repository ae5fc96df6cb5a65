"""The ``k3`` command: ``k3 params | train | sample | plot | convert | inspect | quantize | demo``."""

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
    from k3.model.summary import build_meta_model, format_breakdown, parameter_breakdown

    cfg = _config_from_args(args)
    model = build_meta_model(cfg)
    b = parameter_breakdown(model)
    name = args.config or args.preset
    if args.json:
        print(json.dumps(b.as_dict()))
    else:
        print(format_breakdown(b, f"K3 parameters ({name}; {cfg.num_hidden_layers} layers, "
                                  f"{len(cfg.kda_layer_ids)} KDA + {len(cfg.mla_layer_ids)} MLA, "
                                  f"{cfg.num_experts} experts top-{cfg.num_experts_per_token})"))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="k3", description="K3: Kimi K3 architecture in PyTorch")
    sub = p.add_subparsers(dest="cmd", required=True)

    sp = sub.add_parser("params", help="parameter breakdown of a config (built on the meta device)")
    g = sp.add_mutually_exclusive_group()
    g.add_argument("--preset", default="k3", help="preset name (default k3)")
    g.add_argument("--config", help="path to a config.json (or a checkpoint directory)")
    sp.add_argument("--json", action="store_true", help="print one JSON object")
    sp.set_defaults(func=cmd_params)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args) or 0
    except (ValueError, TypeError, FileNotFoundError) as e:
        print(f"k3 {args.cmd}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
