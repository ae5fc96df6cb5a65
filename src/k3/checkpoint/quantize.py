"""``k3 quantize SRC DST``: export a checkpoint whose routed experts are packed MXFP4 (SPEC §3.7, §4).

What is written is the released K3 format:

- every routed-expert matrix W [out, in] as ``...experts.{e}.w{1,2,3}.weight_packed`` uint8
  [out, in/2] (two E2M1 codes per byte, even element in the low nibble) and ``.weight_scale``
  uint8 [out, in/32] (one E8M0 exponent per block of 32 along ``in``);
- everything else exactly as a normal save writes it (bf16 by default, the fp32-kept tensors in
  fp32), through the same atomic save (``k3.checkpoint.save``);
- ``config.json`` with a compressed-tensors ``quantization_config`` (format
  ``mxfp4-pack-quantized``, one group targeting Linear modules with 4-bit float weights in
  groups of 32, an ignore list of everything that is not a routed expert); its one definition is
  ``k3.checkpoint.names.mxfp4_quantization_config``.

The experts are quantized from the source's stored precision (an fp32 checkpoint is not rounded
to bf16 first), with the same ``quantize_mx`` as QAT's fake quantization, so the packed model
reproduces ``enable_qat``'s logits exactly. A source that already stores packed experts (the
release) has its bytes carried over unchanged. The source model is held in memory once (float
experts for a float source) while the packed copy is made.
"""

from __future__ import annotations

import argparse
import os

import torch

from k3.checkpoint.pretrained import from_pretrained, save_pretrained
from k3.checkpoint.tools import DTYPE_ARGS
from k3.model.decoder import K3ForCausalLM
from k3.model.mx_experts import PackedMXFP4Experts

__all__ = ["quantize", "quantize_main"]


def _export(src, dst, dtype, max_shard_size, strict):
    if os.path.realpath(src) == os.path.realpath(dst):
        raise ValueError("quantize: source and destination are the same directory")
    model = from_pretrained(K3ForCausalLM, src, strict=strict, keep_packed=True)
    return model, save_pretrained(model, dst, max_shard_size, dtype)


def quantize(src: str | os.PathLike, dst: str | os.PathLike, dtype: torch.dtype | None = torch.bfloat16,
             max_shard_size: int | str = "2GB", strict: bool = True) -> list[str]:
    """Read ``src`` (k3, K3 release or Kimi-Linear layout) and write it to ``dst`` with packed MXFP4
    routed experts; return the shard file names. ``dtype`` is the storage dtype of the unquantized
    tensors (None: as stored in ``src``)."""
    return _export(src, dst, dtype, max_shard_size, strict)[1]


def quantize_main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="k3 quantize",
        description="write a checkpoint whose routed experts are packed MXFP4 (compressed-tensors "
                    "mxfp4-pack-quantized, group 32); everything else is saved as by k3 convert")
    p.add_argument("src", help="checkpoint directory (k3, K3 release or Kimi-Linear layout)")
    p.add_argument("dst", help="output directory")
    p.add_argument("--dtype", choices=sorted(DTYPE_ARGS) + ["keep"], default="bf16",
                   help="dtype of the unquantized tensors (fp32-kept tensors stay fp32); 'keep': as stored")
    p.add_argument("--max-shard-size", default="2GB")
    p.add_argument("--lenient", action="store_true", help="skip tensors k3 does not know instead of failing")
    a = p.parse_args(argv)
    if os.path.realpath(a.src) == os.path.realpath(a.dst):
        p.error("SRC and DST must be different directories")
    dtype = None if a.dtype == "keep" else DTYPE_ARGS[a.dtype]
    model, names = _export(a.src, a.dst, dtype, a.max_shard_size, not a.lenient)
    packed = [m for m in model.modules() if isinstance(m, PackedMXFP4Experts)]
    print(f"wrote {len(names)} shard(s) to {a.dst}: {sum(3 * m.num_experts for m in packed)} routed-expert "
          f"matrices packed as MXFP4 ({sum(m.nbytes() for m in packed):,} bytes)")
    return 0
