"""``k3 convert``, ``k3 inspect`` and ``k3 quantize``: the command lines over
``k3.checkpoint.tools`` and ``k3.checkpoint.quantize``."""

from __future__ import annotations

import argparse
import os

from k3.checkpoint.pretrained import model_act_fmt
from k3.checkpoint.quantize import ACTIVATIONS, export
from k3.checkpoint.tools import DTYPE_ARGS, convert, inspect
from k3.model.mx_experts import PackedMXFP4Experts
from k3.checkpoint.dcp import dcp_to_hf, hf_to_dcp, is_dcp_dir

__all__ = ["convert_main", "inspect_main", "quantize_main"]


def convert_main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="k3 convert", description="re-export a checkpoint in k3's layout "
                                "(a distributed run's DCP checkpoint too; --to-dcp for the reverse)")
    p.add_argument("src")
    p.add_argument("dst")
    p.add_argument("--dtype", choices=sorted(DTYPE_ARGS), default=None,
                   help="model dtype (fp32-kept tensors stay fp32); default: as stored")
    p.add_argument("--max-shard-size", default="2GB")
    p.add_argument("--lenient", action="store_true", help="skip tensors k3 does not know instead of failing")
    p.add_argument("--no-verify", action="store_true", help="do not check the source's sha256 hashes")
    p.add_argument("--to-dcp", action="store_true",
                   help="write a model-only torch.distributed.checkpoint folder instead")
    a = p.parse_args(argv)
    if a.to_dcp:
        print(f"wrote a torch.distributed.checkpoint folder to {hf_to_dcp(a.src, a.dst)}")
        return 0
    if is_dcp_dir(a.src):  # a distributed run's checkpoint (or its dcp/ folder) -> HF safetensors
        print(f"wrote the HF safetensors layout to {dcp_to_hf(a.src, a.dst)}")
        return 0
    names = convert(a.src, a.dst, DTYPE_ARGS[a.dtype] if a.dtype else None, a.max_shard_size, not a.lenient,
                    not a.no_verify)
    print(f"wrote {len(names)} shard(s) to {a.dst}")
    return 0


def inspect_main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="k3 inspect", description="summarise a checkpoint without loading it")
    p.add_argument("dir")
    p.add_argument("--no-verify", action="store_true", help="read headers only, skip the sha256 check")
    a = p.parse_args(argv)
    print(inspect(a.dir, not a.no_verify))
    return 0


def quantize_main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="k3 quantize",
        description="write a checkpoint whose routed experts are packed MXFP4 (compressed-tensors "
                    "mxfp4-pack-quantized, group 32); everything else is saved as by k3 convert")
    p.add_argument("src", help="checkpoint directory (k3, K3 release or Kimi-Linear layout) or k3 run directory")
    p.add_argument("dst", help="output directory")
    p.add_argument("--dtype", choices=sorted(DTYPE_ARGS) + ["keep"], default="bf16",
                   help="dtype of the unquantized tensors (fp32-kept tensors stay fp32); 'keep': as stored")
    p.add_argument("--activations", choices=["auto", *ACTIVATIONS], default="auto",
                   help="declared expert input activations: auto = mxfp8 for a run trained with --qat, "
                        "else as the source declares (weights-only for a float source)")
    p.add_argument("--max-shard-size", default="2GB")
    p.add_argument("--lenient", action="store_true", help="skip tensors k3 does not know instead of failing")
    p.add_argument("--no-verify", action="store_true", help="do not check the source's sha256 hashes")
    a = p.parse_args(argv)
    if os.path.realpath(a.src) == os.path.realpath(a.dst):
        p.error("SRC and DST must be different directories")
    dtype = None if a.dtype == "keep" else DTYPE_ARGS[a.dtype]
    model, names = export(a.src, a.dst, dtype, a.max_shard_size, not a.lenient, a.activations, not a.no_verify)
    packed = [m for m in model.modules() if isinstance(m, PackedMXFP4Experts)]
    acts = "MXFP8 activations" if model_act_fmt(model) else "weights-only"
    print(f"wrote {len(names)} shard(s) to {a.dst}: {sum(3 * m.num_experts for m in packed)} routed-expert "
          f"matrices packed as MXFP4 ({sum(m.nbytes() for m in packed):,} bytes), {acts}")
    return 0
