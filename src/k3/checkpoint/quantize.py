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

Activations: ``--activations`` ``auto`` (default), ``none`` or ``mxfp8``. ``auto`` follows the
source: a k3 run directory (or its ``checkpoint/model``) whose ``run.json`` train config says
``qat`` declares MXFP8 ``input_activations`` (compressed-tensors group-32 float8), so the packed
model reproduces the QAT model exactly; a packed source keeps its declaration; anything else is
weights-only (``input_activations`` null). An explicit choice that contradicts the run record or
the source's declaration is refused.

The experts are quantized from the source's stored precision (an fp32 checkpoint is not rounded
to bf16 first), with the same ``quantize_mx`` as QAT's fake quantization, so the packed model
reproduces ``enable_qat``'s logits exactly (with MXFP8 activations declared). A source that already stores packed experts (the
release) has its bytes carried over unchanged. The source model is held in memory once (float
experts for a float source) while the packed copy is made.
"""

from __future__ import annotations

import json
import os

import torch

from k3.checkpoint.load import scan
from k3.checkpoint.names import ACT_FMT, declared_act_fmt
from k3.checkpoint.pretrained import from_pretrained, save_pretrained
from k3.checkpoint.save import CONFIG_NAME
from k3.errors import CheckpointError
from k3.model.mx_experts import PackedMXFP4Experts

__all__ = ["quantize", "resolve_source", "ACTIVATIONS", "export"]

ACTIVATIONS = {"none": None, "mxfp8": ACT_FMT}
RUN_INFO = "run.json"


def _run_qat(run_json: str) -> bool:
    try:
        with open(run_json) as f:
            tc = json.load(f).get("train_config", {})
    except (OSError, ValueError, AttributeError) as e:
        raise CheckpointError(f"{run_json}: unreadable run record ({e})") from None
    qat = tc.get("qat", False) if isinstance(tc, dict) else False
    if not isinstance(qat, bool):
        raise CheckpointError(f"{run_json}: train_config.qat must be true or false, got {qat!r}")
    return qat


def resolve_source(src: str | os.PathLike) -> tuple[str, bool | None]:
    """(model directory, whether it was trained with QAT or None when unknown) for a checkpoint
    directory, a k3 run directory (its ``checkpoint/model``), a run's ``checkpoint`` folder or its
    ``checkpoint/model``; the QAT flag comes from the run's ``run.json``."""
    src = os.fspath(src)
    if os.path.isfile(os.path.join(src, RUN_INFO)):
        model_dir = os.path.join(src, "checkpoint", "model")
        if not os.path.isdir(model_dir):
            raise CheckpointError(f"{src}: a k3 run directory without a complete checkpoint ({model_dir})")
        return model_dir, _run_qat(os.path.join(src, RUN_INFO))
    if not os.path.isfile(os.path.join(src, CONFIG_NAME)) and os.path.isdir(os.path.join(src, "model")):
        run_json = os.path.join(src, os.pardir, RUN_INFO)  # a run's checkpoint folder
        if os.path.isfile(run_json):
            return os.path.join(src, "model"), _run_qat(run_json)
    run_json = os.path.join(src, os.pardir, os.pardir, RUN_INFO)
    if os.path.basename(os.path.normpath(src)) == "model" and os.path.isfile(run_json):
        return src, _run_qat(run_json)
    return src, None


def choose_act_fmt(requested: str, run_qat: bool | None, source_fmt: str | None, source_packed: bool,
                   where: str) -> str | None:
    """The activation format to declare; refuses a request that contradicts the source."""
    if requested != "auto" and requested not in ACTIVATIONS:
        raise CheckpointError(f"--activations must be auto, none or mxfp8, got {requested!r}")
    recorded = ACT_FMT if run_qat else None
    if requested == "auto":
        return source_fmt if source_packed else recorded
    want = ACTIVATIONS[requested]
    if run_qat is not None and want != recorded:
        raise CheckpointError(f"{where}: --activations {requested} contradicts the run record "
                              f"(train_config.qat = {str(run_qat).lower()})")
    if source_packed and want != source_fmt:
        raise CheckpointError(f"{where}: --activations {requested} contradicts the source's "
                              f"quantization_config (input_activations {'MXFP8' if source_fmt else 'null'})")
    return want


def export(src, dst, dtype, max_shard_size, strict, activations="auto", verify=True):
    model_dir, run_qat = resolve_source(src)
    if os.path.realpath(model_dir) == os.path.realpath(dst) or os.path.realpath(src) == os.path.realpath(dst):
        raise CheckpointError(f"{dst}: quantize: source and destination are the same directory")
    files = scan(model_dir, verify=False)  # headers only: what the source declares
    source_fmt = declared_act_fmt(files.quantization, os.path.join(model_dir, CONFIG_NAME))
    source_packed = files.quantization is not None
    act_fmt = choose_act_fmt(activations, run_qat, source_fmt, source_packed, model_dir)
    model = from_pretrained(model_dir, strict=strict, keep_packed=True, verify=verify)
    for m in model.modules():
        if isinstance(m, PackedMXFP4Experts):
            m.act_fmt = act_fmt
    return model, save_pretrained(model, dst, max_shard_size, dtype)


def quantize(src: str | os.PathLike, dst: str | os.PathLike, dtype: torch.dtype | None = torch.bfloat16,
             max_shard_size: int | str = "2GB", strict: bool = True, activations: str = "auto",
             verify: bool = True) -> list[str]:
    """Read ``src`` (k3, K3 release or Kimi-Linear layout, or a k3 run directory) and write it to
    ``dst`` with packed MXFP4 routed experts; return the shard file names. ``dtype`` is the storage
    dtype of the unquantized tensors (None: as stored in ``src``). ``activations``: "auto", "none"
    or "mxfp8" (module docstring). ``verify``: check the source's sha256 first."""
    return export(src, dst, dtype, max_shard_size, strict, activations, verify)[1]
