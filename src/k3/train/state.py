"""Training checkpoints: everything a resumed run needs to continue bit-exactly (SPEC §5).

Layout of ``<run>/checkpoint/``::

    model/              k3.checkpoint layout: config.json, safetensors shards + index
                        (the QB router biases are buffers, so they are in it)
    tokenizer.json      the run's tokenizer
    optimizer.pt        optimizer.state_dict()
    trainer_state.pt    step, data position, RNG states (torch, numpy, python), metrics so far,
                        skip counter, train config, model config, corpus fingerprint
    manifest.json       written last: step and the size + sha256 of every file above

Atomic commit: the new checkpoint is written into a temporary folder beside it, every file and the
folder are fsynced, then ``checkpoint`` is renamed to ``checkpoint.prev``, the temporary folder to
``checkpoint``, and ``checkpoint.prev`` removed. A failure at any point leaves a complete
checkpoint under one of the two names; ``find_checkpoint`` picks the one whose manifest verifies,
so a broken save never replaces a good one.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from k3.errors import CheckpointError
from k3.fsutil import fsync_path

__all__ = ["save_checkpoint", "find_checkpoint", "load_trainer_state", "rng_state", "set_rng_state",
           "save_model_weights", "load_model_weights", "CheckpointCorrupt", "CKPT_NAME"]

CKPT_NAME = "checkpoint"
_PREV = CKPT_NAME + ".prev"
_TMP_PREFIX = ".checkpoint-tmp-"
MANIFEST = "manifest.json"


class CheckpointCorrupt(CheckpointError):
    """A checkpoint folder that is incomplete or whose files do not match its manifest."""


# ------------------------------------------------------------------------------ model weights
def save_model_weights(model: torch.nn.Module, directory: Path) -> None:
    """config.json + HF-named safetensors (k3.checkpoint; fp32 kept as is, so reloading is exact)."""
    from k3.checkpoint import save_pretrained
    save_pretrained(model, directory)


def load_model_weights(model: torch.nn.Module, directory: Path) -> None:
    """Load weights saved by ``save_model_weights`` in place (validated before any copy)."""
    from k3.checkpoint import load_checkpoint
    load_checkpoint(model, directory, strict=True)


# ------------------------------------------------------------------------------------ RNG
def rng_state() -> dict[str, Any]:
    """torch (CPU and CUDA), numpy and python RNG states as tensors / lists (weights_only-safe)."""
    np_state = np.random.get_state()
    py_state = random.getstate()
    st: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": {"name": np_state[0], "keys": torch.from_numpy(np_state[1].astype(np.int64)),
                  "pos": int(np_state[2]), "has_gauss": int(np_state[3]),
                  "cached_gaussian": float(np_state[4])},
        "python": [py_state[0], list(py_state[1]), py_state[2]],
    }
    if torch.cuda.is_available():
        st["cuda"] = torch.cuda.get_rng_state_all()
    return st


def set_rng_state(st: dict[str, Any]) -> None:
    torch.set_rng_state(st["torch"])
    n = st["numpy"]
    np.random.set_state((n["name"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"],
                         n["cached_gaussian"]))
    version, internal, gauss = st["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in st and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(st["cuda"])


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file() and p.name != MANIFEST)


def _write_manifest(root: Path, step: int) -> None:
    files = {p.relative_to(root).as_posix(): {"bytes": p.stat().st_size, "sha256": _sha256(p)}
             for p in _files(root)}
    with open(root / MANIFEST, "w") as f:
        json.dump({"step": step, "files": files}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def verify_checkpoint(path: Path) -> dict[str, Any]:
    """The manifest of a complete checkpoint folder; CheckpointCorrupt naming what is wrong."""
    mpath = path / MANIFEST
    if not mpath.is_file():
        raise CheckpointCorrupt(f"{path}: no {MANIFEST} (the save did not complete)")
    try:
        manifest = json.loads(mpath.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointCorrupt(f"{mpath}: not valid JSON ({e})") from None
    for rel, info in manifest["files"].items():
        p = path / rel
        if not p.is_file():
            raise CheckpointCorrupt(f"{path}: {rel} is missing")
        if p.stat().st_size != info["bytes"] or _sha256(p) != info["sha256"]:
            raise CheckpointCorrupt(f"{path}: {rel} does not match the manifest (size or sha256)")
    return manifest


# ---------------------------------------------------------------------------- save / find
def _recover(run_dir: Path) -> None:
    """Finish or roll back a commit interrupted between its renames; drop stale temp folders."""
    final, prev = run_dir / CKPT_NAME, run_dir / _PREV
    if prev.exists():
        if final.exists():
            try:
                verify_checkpoint(final)
                shutil.rmtree(prev)
            except CheckpointCorrupt:
                shutil.rmtree(final)
                os.rename(prev, final)
        else:
            os.rename(prev, final)
    for p in run_dir.glob(_TMP_PREFIX + "*"):
        shutil.rmtree(p, ignore_errors=True)


def save_checkpoint(run_dir: str | os.PathLike, step: int, write: Callable[[Path], None]) -> Path:
    """Write a checkpoint atomically: ``write(folder)`` fills a temporary folder, then commit.

    If ``write`` (or anything before the commit) raises, the temporary folder is removed and the
    previous checkpoint stays in place untouched.
    """
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    _recover(run_dir)
    tmp = Path(tempfile.mkdtemp(prefix=_TMP_PREFIX, dir=run_dir))
    final, prev = run_dir / CKPT_NAME, run_dir / _PREV
    try:
        write(tmp)
        _write_manifest(tmp, step)
        for p in _files(tmp):
            fsync_path(p)
        for d in sorted({p.parent for p in tmp.rglob("*")} | {tmp}):
            fsync_path(d)
        if final.exists():
            os.rename(final, prev)
        os.rename(tmp, final)
        fsync_path(run_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if prev.exists() and not final.exists():
            os.rename(prev, final)
        raise
    shutil.rmtree(prev, ignore_errors=True)
    return final


def find_checkpoint(run_dir: str | os.PathLike) -> Path | None:
    """The run's complete checkpoint folder, or None if the run has none (after crash recovery)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return None
    for cand in (run_dir / CKPT_NAME, run_dir / _PREV):
        if cand.is_dir():
            try:
                verify_checkpoint(cand)
                return cand
            except CheckpointCorrupt:
                continue
    return None


def load_trainer_state(ckpt: Path) -> dict[str, Any]:
    return torch.load(ckpt / "trainer_state.pt", map_location="cpu", weights_only=True)
