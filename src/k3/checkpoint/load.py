"""Read any supported checkpoint directory into K3 tensors: scan, validate, then stream.

Three passes, so bad input never leaves a model half-loaded:

1. :func:`scan` reads ``config.json`` and every shard *header*, and (``verify=True``, the
   default) checks every shard's sha256 against the index metadata k3 writes
   (``metadata.sha256``): a flipped bit, a NaN or zeroed block fails naming the file. A checkpoint
   without hashes (not written by k3) loads after a one-line notice (logged once per directory);
   ``verify=False`` skips the check (huge trusted checkpoints);
2. :func:`plan_load` maps each on-disk tensor to its internal name (``names.resolve``) and checks
   the whole set against ``expected_tensors``: missing / unexpected / mis-shaped / wrong-dtype
   tensors are all reported in one :class:`CheckpointError` naming file and tensor;
3. :func:`stream_into` copies shard by shard with ``safe_open`` (peak memory = destination + one
   tensor), reshaping ``A_log`` and either dequantizing packed MXFP4 experts into float experts or,
   for a model that keeps them packed (``plan_load(..., packed=True)``), copying their bytes as-is.

A multimodal load (``K3VLForConditionalGeneration``) adds :func:`plan_vision` in pass 2: the
tensors a text load ignores are checked against the vision_config's tower and projector and
streamed by the same :func:`stream_into`.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Mapping

import torch
from safetensors import safe_open

from k3.checkpoint.io import CheckpointError, TensorInfo, read_header, sha256_file
from k3.checkpoint.names import (QUANT_CONFIG_KEY, TEXT_PREFIX, Target, check_file_shape, expected_tensors,
                                 expected_vision_tensors, file_names, is_packed_buffer, keeps_fp32, not_text, resolve,
                                 storage_dtype, to_internal)
from k3.checkpoint.save import CONFIG_NAME, INDEX_FORMAT, INDEX_NAME, SHA256_KEY
from k3.config import K3Config
from k3.ops.mx import dequantize_mx, unpack_fp4
from k3.config.vision import VisionConfig

__all__ = ["CheckpointFiles", "LoadPlan", "read_config", "scan", "plan_load", "plan_vision", "stream_into",
           "load_state_dict", "checkpoint_dtype", "verify_files"]

log = logging.getLogger("k3.checkpoint")
_SHARD_RE = re.compile(r"^model-.*\d{5}-of-\d{5}\.safetensors$")
_NOTICED: set[str] = set()  # directories already given the "no hashes" notice in this process


def read_config(directory: str) -> K3Config:
    path = os.path.join(directory, CONFIG_NAME)
    try:
        with open(path) as f:
            d = json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no config.json in the checkpoint directory") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(d, dict):
        raise CheckpointError(f"{path}: expected a JSON object, got {type(d).__name__}")
    try:
        return K3Config.from_dict(d)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{path}: invalid config: {e}") from None


@dataclass
class CheckpointFiles:
    """A checkpoint directory as seen through its headers: config and on-disk tensor infos.

    ``quantization`` is config.json's ``quantization_config`` (top level or inside
    ``text_config``), taken out of ``config``: it describes how the files store tensors, not the
    model, so a model built from the config carries none and its saves write their own.
    """

    directory: str
    config: K3Config
    tensors: dict[str, TensorInfo]
    multimodal: bool
    quantization: dict | None = None


def _read_index(index: str) -> dict:
    try:
        with open(index) as f:
            d = json.load(f)
        if not isinstance(d, dict) or not isinstance(d.get("weight_map"), dict):
            raise TypeError("weight_map is not an object")
        if not isinstance(d.get("metadata", {}), dict):
            raise TypeError("metadata is not an object")
    except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as e:
        raise CheckpointError(f"{index}: corrupt index ({type(e).__name__}: {e})") from None
    return d


def _shard_list(directory: str) -> tuple[list[str], dict[str, str] | None, dict | None]:
    """(shard file names, index weight_map or None, index metadata or None)."""
    index = os.path.join(directory, INDEX_NAME)
    if os.path.exists(index):
        d = _read_index(index)
        weight_map = d["weight_map"]
        for name, shard in weight_map.items():
            if not isinstance(shard, str) or os.path.basename(shard) != shard:
                raise CheckpointError(f"{index}: tensor {name!r} points to an invalid shard name {shard!r}")
            if not os.path.isfile(os.path.join(directory, shard)):
                raise CheckpointError(f"{index}: tensor {name!r} points to missing shard "
                                      f"{os.path.join(directory, shard)}")
        return sorted(set(weight_map.values())), weight_map, d.get("metadata", {})
    single = os.path.join(directory, "model.safetensors")
    if os.path.isfile(single):
        return ["model.safetensors"], None, None
    orphans = [f for f in os.listdir(directory) if _SHARD_RE.match(f)]
    if orphans:  # shards renamed but the index never committed: an interrupted save
        raise CheckpointError(f"{directory}: shards {sorted(orphans)[:3]}... but no {INDEX_NAME} "
                              "(an interrupted save?)")
    raise CheckpointError(f"{directory}: no {INDEX_NAME} or model.safetensors")


def verify_files(directory: str, shards: list[str], metadata: dict | None) -> bool:
    """Check each shard's sha256 against ``metadata["sha256"]``; return False (after a one-line
    notice, once per directory) when the checkpoint carries no hashes. Raises naming the file."""
    hashes = (metadata or {}).get(SHA256_KEY)
    index = os.path.join(directory, INDEX_NAME)
    if hashes is None:
        key = os.path.realpath(directory)
        if key not in _NOTICED:
            _NOTICED.add(key)
            origin = "written by an older k3" if (metadata or {}).get("format") == INDEX_FORMAT \
                else "not written by k3"
            log.warning("k3: %s carries no sha256 hashes (%s); loading without verifying its bytes",
                        directory, origin)
        return False
    if not isinstance(hashes, dict):
        raise CheckpointError(f"{index}: metadata.{SHA256_KEY} is not an object")
    paths = [os.path.join(directory, shard) for shard in shards]
    for shard, path in zip(shards, paths):
        if not isinstance(hashes.get(shard), str):
            raise CheckpointError(f"{path}: no sha256 for this shard in {index}")
    # hashlib releases the GIL on large buffers: shards hash in parallel, one thread each
    with ThreadPoolExecutor(max_workers=max(1, min(len(paths), os.cpu_count() or 1))) as pool:
        digests = list(pool.map(sha256_file, paths))
    for shard, path, got in zip(shards, paths, digests):
        want = hashes[shard]
        if got != want:
            raise CheckpointError(f"{path}: sha256 mismatch, the file changed after it was written "
                                  f"(corrupt?); expected {want[:16]}..., got {got[:16]}... "
                                  "(verify=False / --no-verify loads it anyway)")
    return True


def scan(directory: str | os.PathLike, verify: bool = True) -> CheckpointFiles:
    """Config and all shard headers of a checkpoint directory; with ``verify`` also every shard's
    sha256 (reads each file once); without it no tensor data is read."""
    directory = os.fspath(directory)
    if not os.path.exists(directory):
        raise CheckpointError(f"{directory}: no such checkpoint directory")
    if not os.path.isdir(directory):
        raise CheckpointError(f"{directory}: not a directory (expected a checkpoint directory)")
    config = read_config(directory)
    shards, weight_map, metadata = _shard_list(directory)
    tensors: dict[str, TensorInfo] = {}
    for shard in shards:
        for name, info in read_header(os.path.join(directory, shard)).items():
            if name in tensors:
                raise CheckpointError(f"{info.file}: tensor {name!r} also stored in {tensors[name].file}")
            if weight_map is not None and weight_map.get(name) != shard:
                raise CheckpointError(f"{info.file}: tensor {name!r} is not listed for this shard "
                                      f"in {INDEX_NAME}")
            tensors[name] = info
    if weight_map is not None:
        for name, shard in weight_map.items():
            if name not in tensors:
                raise CheckpointError(f"{os.path.join(directory, shard)}: tensor {name!r} listed in "
                                      f"{INDEX_NAME} is not in the shard")
    if verify:  # after the headers: a truncated or malformed file gets the more precise message
        verify_files(directory, shards, metadata)
    multimodal = any(n.startswith(TEXT_PREFIX) for n in tensors)
    quantization = config.extra.pop(QUANT_CONFIG_KEY, None)
    if config.wrapper is not None:
        quantization = config.wrapper.pop(QUANT_CONFIG_KEY, None) or quantization
    return CheckpointFiles(directory, config, tensors, multimodal, quantization)


@dataclass
class LoadPlan:
    """Validated mapping: per shard file, the (target, info) pairs to copy; plus what was skipped."""

    by_file: dict[str, list[tuple[Target, TensorInfo]]] = field(default_factory=lambda: defaultdict(list))
    ignored: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)


def _check_one(target: Target, info: TensorInfo, config: K3Config) -> str | None:
    where = f"{info.file}: tensor {info.name!r}"
    want = check_file_shape(target, info.shape, config)
    if want is not None:
        return f"{where}: shape {list(info.shape)}, expected {want} (for {target.name})"
    if target.kind in ("packed", "scale"):
        if info.dtype != torch.uint8:
            return f"{where}: MXFP4 {'codes' if target.kind == 'packed' else 'scales'} must be uint8, got {info.dtype}"
    elif not info.dtype.is_floating_point:
        return f"{where}: expected a floating-point tensor, got {info.dtype}"
    return None


def plan_load(files: CheckpointFiles, config: K3Config, strict: bool = True, packed: bool = False) -> LoadPlan:
    """Validate every on-disk tensor against ``expected_tensors(config, packed=packed)``; raise on
    any problem. ``packed``: the destination keeps routed experts as MXFP4 bytes, so the checkpoint
    must store them packed (``.weight_packed`` + ``.weight_scale``)."""
    expected = expected_tensors(config, packed=packed)
    plan, problems = LoadPlan(), []
    covered: dict[str, str] = {}
    expert_kinds: dict[tuple[str, int], dict[str, str]] = defaultdict(dict)
    for name, info in files.tensors.items():
        target = resolve(name, config, expected, files.multimodal)
        if target is None:
            plan.unexpected.append(name)
            continue
        if target.kind == "ignored":
            plan.ignored.append(name)
            continue
        bad = _check_one(target, info, config)
        if bad:
            problems.append(bad)
            continue
        if target.expert is None:
            prev = covered.setdefault(target.name, name)
        else:
            prev = expert_kinds[(target.name, target.expert)].setdefault(target.kind, name)
        if prev != name:
            problems.append(f"{info.file}: tensor {name!r} and tensor {prev!r} both provide {target.name}"
                            + (f" expert {target.expert}" if target.expert is not None else ""))
            continue
        plan.by_file[info.file].append((target, info))
    for name, (shape, _) in expected.items():
        if ".experts.w" not in name:
            if name not in covered:
                problems.append(f"{files.directory}: missing tensor {name}")
            continue
        raw_kind = name.rsplit("_", 1)[1] if is_packed_buffer(name) else None  # "packed" / "scale"
        for fname, e in file_names(name, shape):
            kinds = set(expert_kinds.get((name, e), {}))
            if raw_kind is not None:
                if kinds != {raw_kind}:
                    problems.append(f"{files.directory}: missing tensor {fname} (experts are kept packed)")
            elif kinds in ({"packed"}, {"scale"}):  # half of an MXFP4 pair: name the other half
                other = "scale" if kinds == {"packed"} else "packed"
                problems.append(f"{files.directory}: missing tensor {fname}_{other}: incomplete MXFP4 "
                                f"{fname} (found only {sorted(kinds)})")
            elif kinds not in ({"plain"}, {"packed", "scale"}):
                have = f" (found only {sorted(kinds)})" if kinds else ""
                problems.append(f"{files.directory}: missing tensor {fname}{have}")
    if plan.unexpected and strict:
        problems += [f"{files.tensors[n].file}: unexpected tensor {n!r}" for n in plan.unexpected]
    _settle(files, plan, problems, "the model", "tensor")
    if plan.ignored:
        log.info("%s: ignoring %d vision/projector tensor(s) (k3 loads the text model)",
                 files.directory, len(plan.ignored))
    return plan


def plan_vision(files: CheckpointFiles, vc: VisionConfig, strict: bool = True) -> LoadPlan:
    """Validate a checkpoint's vision tensors (the ones a text load ignores, ``names.not_text``)
    against ``names.expected_vision_tensors(vc)``: a missing, mis-shaped or non-float tensor, or
    (``strict``) an unexpected one, is a :class:`CheckpointError` naming it. The plan streams with
    :func:`stream_into` into the model's ``vision_tower.…`` / ``mm_projector.…`` tensors."""
    expected = expected_vision_tensors(vc)
    plan, problems = LoadPlan(), []
    for name, info in files.tensors.items():
        if not not_text(name, files.multimodal):
            continue
        if name not in expected:
            plan.unexpected.append(name)
            continue
        target = Target(name, "plain", None, expected[name])
        where = f"{info.file}: vision tensor {name!r}"
        if tuple(info.shape) != expected[name]:
            problems.append(f"{where}: shape {list(info.shape)}, expected {list(expected[name])} "
                            "(from the vision_config)")
        elif not info.dtype.is_floating_point:
            problems.append(f"{where}: expected a floating-point tensor, got {info.dtype}")
        else:
            plan.by_file[info.file].append((target, info))
    problems += [f"{files.directory}: missing vision tensor {n}" for n in expected if n not in files.tensors]
    if plan.unexpected and strict:
        problems += [f"{files.tensors[n].file}: unexpected vision tensor {n!r}" for n in plan.unexpected]
    _settle(files, plan, problems, "the vision model", "vision tensor")
    return plan


def _settle(files: CheckpointFiles, plan: LoadPlan, problems: list[str], what: str, kind: str) -> None:
    """One CheckpointError listing every problem (the first 20), else a warning naming the
    unexpected tensors a non-strict load leaves out."""
    if problems:
        shown = problems[:20] + ([f"... and {len(problems) - 20} more"] if len(problems) > 20 else [])
        raise CheckpointError(f"checkpoint {files.directory} does not match {what} "
                              f"({len(problems)} problem(s)):\n  " + "\n  ".join(shown))
    if plan.unexpected:
        log.warning("%s: ignoring %d unexpected %s(s): %s", files.directory, len(plan.unexpected), kind,
                    ", ".join(plan.unexpected[:10]) + (" ..." if len(plan.unexpected) > 10 else ""))


def _dequant(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """MXFP4 expert matrix: packed uint8 [out, in/2] + E8M0 scales [out, in/32] -> fp32 [out, in]."""
    n = packed.shape[-1] * 2
    return dequantize_mx(unpack_fp4(packed, n), scale, "fp4_e2m1", 32, torch.float32)


@torch.no_grad()
def stream_into(plan: LoadPlan, dest: Mapping[str, torch.Tensor], config: K3Config) -> None:
    """Copy every planned tensor into ``dest[internal name]`` (cast to the destination dtype).

    Runs single-threaded: the copies are memory-bound and many are small (one expert each), where
    intra-op thread hand-offs cost more than the copy (measured 20x slower on a busy 2-core host).
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _stream(plan, dest, config)
    finally:
        torch.set_num_threads(threads)


def _stream(plan: LoadPlan, dest: Mapping[str, torch.Tensor], config: K3Config) -> None:
    pending: dict[tuple[str, int], dict[str, torch.Tensor]] = defaultdict(dict)
    for path, items in plan.by_file.items():
        try:
            with safe_open(path, framework="pt", device="cpu") as f:
                for target, info in items:
                    t = f.get_tensor(info.name)
                    out = dest[target.name]
                    if target.kind == "plain" or is_packed_buffer(target.name):
                        t = to_internal(target, t, config)
                        (out if target.expert is None else out[target.expert]).copy_(t)
                        continue
                    slot = pending[(target.name, target.expert)]
                    slot[target.kind] = t
                    if len(slot) == 2:
                        out[target.expert].copy_(_dequant(slot["packed"], slot["scale"]))
                        del pending[(target.name, target.expert)]
        except CheckpointError:
            raise
        except Exception as e:  # safetensors reports corrupt data as several exception types
            raise CheckpointError(f"{path}: cannot read tensor data ({type(e).__name__}: {e})") from None


def checkpoint_dtype(files: CheckpointFiles) -> torch.dtype:
    """The dtype most bytes of the non-fp32-kept float tensors are stored in (fp32 if none)."""
    nbytes: dict[torch.dtype, int] = defaultdict(int)
    for name, info in files.tensors.items():
        if info.dtype.is_floating_point and not keeps_fp32(name):
            nbytes[info.dtype] += info.numel
    return max(nbytes, key=nbytes.get) if nbytes else torch.float32


def load_state_dict(directory: str | os.PathLike, dtype: torch.dtype | None = None, strict: bool = True,
                    verify: bool = True) -> tuple[K3Config, dict[str, torch.Tensor]]:
    """A checkpoint as ``(config, internal-name state dict)`` without building a model.

    ``dtype`` None keeps the checkpoint's dtype; fp32-kept tensors are always fp32. ``verify``:
    check the shards' sha256 first (see :func:`scan`).
    """
    files = scan(directory, verify)
    config = files.config
    plan = plan_load(files, config, strict)
    dtype = dtype or checkpoint_dtype(files)
    sd = {n: torch.empty(s, dtype=storage_dtype(n, dtype)) for n, (s, _) in expected_tensors(config).items()}
    stream_into(plan, sd, config)
    return config, sd
