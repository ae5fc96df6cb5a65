"""Write a K3 state dict as HF-named safetensors shards + index + config.json, atomically.

Commit protocol (a crash, even ``kill -9``, at any point leaves the previous checkpoint in the
directory loadable and never a half-written one that loads):

1. every shard is written under a temporary name (``.k3tmp-...``) and fsynced;
2. shards are renamed to final names that no file of the previous checkpoint uses, so the previous
   index still points at intact shards;
3. ``config.json`` is renamed into place, then ``model.safetensors.index.json`` last: the index
   rename is the commit point; the directory is fsynced;
4. shards of the previous checkpoint that the new index does not use are removed.

Between 3's two renames a crash leaves the new config beside the old index; that only matters if
the config changed, and then validation rejects the pair instead of loading a mixture.

Integrity: each shard's sha256 is computed from the bytes as they are written and stored in the
index, ``metadata.sha256 = {shard file: hex digest}`` (``metadata.format = "k3"``); every load
path checks it (``k3.checkpoint.load.scan``). Step 4 removes only files the previous *k3* index
lists under k3's own shard names: a foreign or stale index never makes k3 delete a file it did not
write. Before the first byte, the checkpoint's size is compared with the free space of the
directory's filesystem (refused with how much is needed).

A state dict whose routed experts are packed MXFP4 (``experts.wN_packed`` / ``_scale`` buffers of
``PackedMXFP4Experts``) is written as the release stores it, ``experts.{e}.wN.weight_packed`` /
``.weight_scale`` uint8, and ``config.json`` then carries the compressed-tensors
``quantization_config`` (``names.mxfp4_quantization_config``); any other save drops that key.

With ``vision`` tensors (a ``K3VLForConditionalGeneration``) the release's multimodal layout is
written: text tensors under ``language_model.``, ``vision_tower.…`` / ``mm_projector.…`` as floats,
config.json the kimi_k3 wrapper (``text_config`` + ``vision_config`` + wrapper keys).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
from typing import Mapping

import torch

from k3.checkpoint.io import CheckpointError, parse_size, write_json_atomic, write_safetensors
from k3.checkpoint.kimi_linear import a_log_file_shape, is_kimi_linear_mode, kimi_linear_config_fields
from k3.config.hf import wrap_text_config
from k3.checkpoint.names import (
    QUANT_CONFIG_KEY,
    TEXT_PREFIX,
    expected_tensors,
    expected_vision_tensors,
    file_names,
    holds_packed_experts,
    mxfp4_quantization_config,
    storage_dtype,
)
from k3.config import K3Config
from k3.errors import ConfigError
from k3.fsutil import fsync_path
from k3.config.vision import vision_config_of

__all__ = ["save_state_dict", "INDEX_NAME", "CONFIG_NAME", "TMP_PREFIX", "CRASH_ENV", "INDEX_FORMAT",
           "SHA256_KEY", "K3_SHARD_RE", "check_free_space"]

INDEX_NAME = "model.safetensors.index.json"
CONFIG_NAME = "config.json"
TMP_PREFIX = ".k3tmp-"
CRASH_ENV = "K3_CHECKPOINT_CRASH_AT"  # test hook: "shard:N" or "commit" -> SIGKILL self there
INDEX_FORMAT = "k3"  # index metadata "format" of a k3-written checkpoint
SHA256_KEY = "sha256"  # index metadata key: {shard file name: sha256 hex}
K3_SHARD_RE = re.compile(r"^model-(?:g\d+-)?\d{5}-of-\d{5}\.safetensors$")  # names _shard_names makes
_HEADER_SLACK = 1 << 20  # headers, config.json and index: generous upper bound in bytes


def _crash_point(where: str) -> None:
    if os.environ.get(CRASH_ENV) == where:
        os.kill(os.getpid(), signal.SIGKILL)


def _check_state_dict(state_dict: Mapping[str, torch.Tensor], config: K3Config) -> None:
    expected = expected_tensors(config, packed=holds_packed_experts(state_dict))
    names = set(state_dict) - ({"lm_head.weight"} if config.tie_word_embeddings else set())
    missing, unexpected = sorted(set(expected) - names), sorted(names - set(expected))
    bad = [f"{n}: shape {list(state_dict[n].shape)}, expected {list(expected[n][0])}"
           for n in sorted(names & set(expected)) if tuple(state_dict[n].shape) != expected[n][0]]
    if missing or unexpected or bad:
        raise CheckpointError("state dict does not match the config: "
                              + "; ".join(filter(None, [f"missing {missing}" if missing else "",
                                                        f"unexpected {unexpected}" if unexpected else "",
                                                        *bad])))


def _file_tensors(state_dict: Mapping[str, torch.Tensor], config: K3Config,
                  dtype: torch.dtype | None) -> list[tuple[str, torch.Tensor, torch.dtype]]:
    """(on-disk name, tensor view, storage dtype) in state-dict order, experts unstacked."""
    out = []
    expected = expected_tensors(config, packed=holds_packed_experts(state_dict))
    for name, t in state_dict.items():
        if name not in expected:  # tied lm_head
            continue
        want = storage_dtype(name, dtype or t.dtype)
        if name.endswith(".A_log"):
            t = a_log_file_shape(config, t)
        for fname, e in file_names(name, tuple(t.shape)):
            out.append((fname, t if e is None else t[e], want))
    return out


def _plan_shards(items: list[tuple[str, torch.Tensor, torch.dtype]], max_bytes: int) -> list[list]:
    shards: list[list] = [[]]
    size = 0
    for item in items:
        nbytes = item[1].numel() * torch.empty((), dtype=item[2]).element_size()
        if shards[-1] and size + nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(item)
        size += nbytes
    return shards


def _shard_names(directory: str, n: int) -> list[str]:
    """HF shard names, with a generation tag when a file of the previous checkpoint has the name."""
    existing = set(os.listdir(directory))
    for gen in range(10_000):
        tag = "" if gen == 0 else f"g{gen}-"
        names = [f"model-{tag}{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
        if existing.isdisjoint(names):
            return names
    raise CheckpointError(f"{directory}: no free shard file names")


def _previous_shards(directory: str) -> set[str]:
    """Shards of the previous checkpoint that k3 wrote (k3 index format, k3 shard names); a
    foreign or unreadable index gives none, so nothing it lists is ever deleted."""
    try:
        with open(os.path.join(directory, INDEX_NAME)) as f:
            index = json.load(f)
        if index.get("metadata", {}).get("format") != INDEX_FORMAT:
            return set()
        return {s for s in index.get("weight_map", {}).values()
                if isinstance(s, str) and K3_SHARD_RE.match(s)}
    except (OSError, ValueError, AttributeError):
        return set()


def check_free_space(directory: str, needed: int) -> None:
    """Refuse (naming the directory and both sizes) when its filesystem has under ``needed`` bytes free."""
    free = shutil.disk_usage(directory).free
    if free < needed:
        raise CheckpointError(f"{directory}: not enough free space for the checkpoint: needs "
                              f"{needed / 1e6:,.1f} MB, {free / 1e6:,.1f} MB free")


def _check_vision(vision: Mapping[str, torch.Tensor], config: K3Config) -> None:
    """The vision tensors of a multimodal save against the config's vision_config (names, shapes)."""
    try:
        vc = vision_config_of(config)
    except ConfigError as e:
        raise CheckpointError(f"cannot save the vision tensors: {e}") from None
    if vc is None:
        raise CheckpointError("vision tensors given but the config has no vision_config")
    expected = expected_vision_tensors(vc)
    missing, unexpected = sorted(set(expected) - set(vision)), sorted(set(vision) - set(expected))
    bad = [f"{n}: shape {list(vision[n].shape)}, expected {list(expected[n])}"
           for n in sorted(set(vision) & set(expected)) if tuple(vision[n].shape) != expected[n]]
    bad += [f"{n}: {vision[n].dtype} is not a floating-point dtype" for n in sorted(vision)
            if not vision[n].is_floating_point()]
    if missing or unexpected or bad:
        raise CheckpointError("vision tensors do not match the vision_config: "
                              + "; ".join(filter(None, [f"missing {missing}" if missing else "",
                                                        f"unexpected {unexpected}" if unexpected else "",
                                                        *bad])))


def _config_json(state_dict: Mapping[str, torch.Tensor], config: K3Config, act_fmt: str | None,
                 multimodal: bool = False) -> dict:
    config_json = config.to_text_dict()
    config_json.pop(QUANT_CONFIG_KEY, None)
    quant = None
    if holds_packed_experts(state_dict):
        quant = mxfp4_quantization_config(act_fmt, multimodal=multimodal)
    elif act_fmt is not None:
        raise CheckpointError(f"activation format {act_fmt!r} is declared only for packed MXFP4 experts")
    if is_kimi_linear_mode(config):
        for k, v in kimi_linear_config_fields(config).items():
            config_json.setdefault(k, v)
    if not multimodal:
        if quant is not None:
            config_json[QUANT_CONFIG_KEY] = quant
        return config_json
    out = wrap_text_config(config, config_json)  # kimi_k3 wrapper; the release declares quantization on top
    out.pop(QUANT_CONFIG_KEY, None)
    if quant is not None:
        out[QUANT_CONFIG_KEY] = quant
    return out


def save_state_dict(state_dict: Mapping[str, torch.Tensor], config: K3Config, directory: str | os.PathLike,
                    max_shard_size: int | str = "2GB", dtype: torch.dtype | None = None,
                    act_fmt: str | None = None, vision: Mapping[str, torch.Tensor] | None = None) -> list[str]:
    """Save a K3 state dict (internal names) in k3's layout; return the shard file names.

    ``dtype`` casts every tensor except the fp32-kept ones (conv weights, ``A_log``, ``dt_bias``,
    ``o_norm``, ``e_score_correction_bias``); None keeps each tensor's dtype. ``act_fmt``
    (packed experts only): the declared ``input_activations``, None or "fp8_e4m3" (MXFP8).

    ``vision`` (the tower and projector tensors by their names, ``names.expected_vision_tensors``
    of the config's ``vision_config``) writes the release's multimodal layout: text tensors
    prefixed ``language_model.``, the vision tensors unprefixed as floats (``dtype``, else their
    own dtype; never MXFP4), and config.json in the kimi_k3 wrapper form (``config``'s wrapper
    keys, ``text_config``, ``vision_config``; a ``quantization_config`` goes on top and ignores
    the vision modules).
    """
    directory = os.fspath(directory)
    _check_state_dict(state_dict, config)
    if vision is not None:
        _check_vision(vision, config)
    max_bytes = parse_size(max_shard_size)
    config_json = _config_json(state_dict, config, act_fmt, multimodal=vision is not None)
    items = _file_tensors(state_dict, config, dtype)
    if vision is not None:
        items = [(TEXT_PREFIX + n, t, d) for n, t, d in items] + [(n, t, dtype or t.dtype) for n, t in vision.items()]
    shards = _plan_shards(items, max_bytes)
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise CheckpointError(f"{directory}: not a directory (a file is in the way)")
    os.makedirs(directory, exist_ok=True)
    check_free_space(directory, sum(t.numel() * torch.empty((), dtype=d).element_size() for _, t, d in items)
                     + _HEADER_SLACK)
    for f in os.listdir(directory):  # leftovers of an interrupted save
        if f.startswith(TMP_PREFIX):
            os.remove(os.path.join(directory, f))
    previous = _previous_shards(directory)
    names = _shard_names(directory, len(shards))
    tmp = f"{TMP_PREFIX}{os.getpid()}-"
    try:
        weight_map, hashes, total = _write_shards(shards, names, directory, tmp)
        index = {"metadata": {"total_size": total, "format": INDEX_FORMAT, SHA256_KEY: hashes},
                 "weight_map": weight_map}
        _commit(directory, tmp, names, config_json, index)
    except BaseException:
        _remove_temps(directory, tmp)  # free the space a failed save took (ENOSPC)
        raise
    for old in previous - set(names):
        path = os.path.join(directory, old)
        if os.path.isfile(path):
            os.remove(path)
    return names


def _write_shards(shards: list[list], names: list[str], directory: str, tmp: str):
    weight_map: dict[str, str] = {}
    hashes: dict[str, str] = {}
    total = 0
    for i, (shard, fname) in enumerate(zip(shards, names), 1):
        with torch.no_grad():
            tensors = [(n, t.to(d)) for n, t, d in shard]
        total += sum(t.numel() * t.element_size() for _, t in tensors)
        _, hashes[fname] = write_safetensors(os.path.join(directory, tmp + fname), tensors)
        weight_map.update({n: fname for n, _ in tensors})
        del tensors
        _crash_point(f"shard:{i}")
    return weight_map, hashes, total


def _remove_temps(directory: str, tmp: str) -> None:
    for f in os.listdir(directory):
        if f.startswith(tmp):
            try:
                os.remove(os.path.join(directory, f))
            except OSError:
                pass


def _commit(directory: str, tmp: str, names: list[str], config_json: dict, index: dict) -> None:
    cfg_tmp = write_json_atomic(os.path.join(directory, CONFIG_NAME), config_json,
                                os.path.join(directory, tmp + CONFIG_NAME))
    idx_tmp = write_json_atomic(os.path.join(directory, INDEX_NAME), index,
                                os.path.join(directory, tmp + INDEX_NAME))
    for fname in names:
        os.replace(os.path.join(directory, tmp + fname), os.path.join(directory, fname))
    fsync_path(directory)
    os.replace(cfg_tmp, os.path.join(directory, CONFIG_NAME))
    _crash_point("commit")
    os.replace(idx_tmp, os.path.join(directory, INDEX_NAME))
    fsync_path(directory)
