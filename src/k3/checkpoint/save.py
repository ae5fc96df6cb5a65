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

A state dict whose routed experts are packed MXFP4 (``experts.wN_packed`` / ``_scale`` buffers of
``PackedMXFP4Experts``) is written as the release stores it, ``experts.{e}.wN.weight_packed`` /
``.weight_scale`` uint8, and ``config.json`` then carries the compressed-tensors
``quantization_config`` (``names.mxfp4_quantization_config``); any other save drops that key.
"""

from __future__ import annotations

import json
import os
import signal
from typing import Mapping

import torch

from k3.checkpoint.io import CheckpointError, parse_size, write_json_atomic, write_safetensors
from k3.checkpoint.names import (
    QUANT_CONFIG_KEY,
    expected_tensors,
    file_names,
    holds_packed_experts,
    mxfp4_quantization_config,
    storage_dtype,
)
from k3.config import K3Config
from k3.fsutil import fsync_path

__all__ = ["save_state_dict", "INDEX_NAME", "CONFIG_NAME", "TMP_PREFIX", "CRASH_ENV"]

INDEX_NAME = "model.safetensors.index.json"
CONFIG_NAME = "config.json"
TMP_PREFIX = ".k3tmp-"
CRASH_ENV = "K3_CHECKPOINT_CRASH_AT"  # test hook: "shard:N" or "commit" -> SIGKILL self there


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
    try:
        with open(os.path.join(directory, INDEX_NAME)) as f:
            return set(json.load(f).get("weight_map", {}).values())
    except (OSError, ValueError, AttributeError):
        return set()


def save_state_dict(state_dict: Mapping[str, torch.Tensor], config: K3Config, directory: str | os.PathLike,
                    max_shard_size: int | str = "2GB", dtype: torch.dtype | None = None) -> list[str]:
    """Save a K3 state dict (internal names) in k3's layout; return the shard file names.

    ``dtype`` casts every tensor except the fp32-kept ones (conv weights, ``A_log``, ``dt_bias``,
    ``o_norm``, ``e_score_correction_bias``); None keeps each tensor's dtype.
    """
    directory = os.fspath(directory)
    _check_state_dict(state_dict, config)
    max_bytes = parse_size(max_shard_size)
    os.makedirs(directory, exist_ok=True)
    config_json = config.to_text_dict()
    config_json.pop(QUANT_CONFIG_KEY, None)
    if holds_packed_experts(state_dict):
        config_json[QUANT_CONFIG_KEY] = mxfp4_quantization_config()
    for f in os.listdir(directory):  # leftovers of an interrupted save
        if f.startswith(TMP_PREFIX):
            os.remove(os.path.join(directory, f))
    previous = _previous_shards(directory)
    shards = _plan_shards(_file_tensors(state_dict, config, dtype), max_bytes)
    names = _shard_names(directory, len(shards))
    tmp = f"{TMP_PREFIX}{os.getpid()}-"
    weight_map: dict[str, str] = {}
    total = 0
    for i, (shard, fname) in enumerate(zip(shards, names), 1):
        with torch.no_grad():
            tensors = [(n, t.to(d)) for n, t, d in shard]
        total += sum(t.numel() * t.element_size() for _, t in tensors)
        write_safetensors(os.path.join(directory, tmp + fname), tensors)
        weight_map.update({n: fname for n, _ in tensors})
        del tensors
        _crash_point(f"shard:{i}")
    index = {"metadata": {"total_size": total, "format": "k3"}, "weight_map": weight_map}
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
    for old in previous - set(names):
        path = os.path.join(directory, old)
        if os.path.basename(old) == old and os.path.isfile(path):
            os.remove(path)
    return names
