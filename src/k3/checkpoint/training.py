"""The training-checkpoint format: everything a resumed run needs to continue bit-exactly (SPEC §5).

A run directory's checkpoint folder, as one process writes it (``k3.train.loop``; a distributed run
writes ``dcp/`` instead of ``model/`` + ``optimizer.pt``: :mod:`k3.checkpoint.dcp`).

Layout of a checkpoint folder (``<run>/checkpoint`` points to the current one)::

    model/              k3.checkpoint layout: config.json, safetensors shards + index
                        (the QB router biases are buffers, so they are in it)
    tokenizer.json      the run's tokenizer
    optimizer.pt        optimizer.state_dict()
    trainer_state.pt    step, data position, RNG states (torch, numpy, python), metrics so far,
                        skip counter, train config, model config, corpus fingerprint
    manifest.json       written last: step and the size + sha256 of every file above

Versioned commit: ``checkpoint`` is a symlink to the current version folder
``checkpoint-<step>-<random>/``. A save fills a temporary folder, fsyncs every file and folder,
renames it to a fresh version name, then atomically replaces the symlink (``os.replace`` of a new
link): that rename is the commit point. A crash at any point leaves the pointer on a complete
checkpoint. Old versions are deleted by later saves, except one a reader has pinned: readers
(``pinned_checkpoint`` / ``read_checkpoint``) hold a shared flock on the version's manifest while
they load, and the saver deletes a version only under an exclusive non-blocking flock, so a load
sees either the previous complete checkpoint or the new one, never a folder being removed.
Only the process holding the run lock (``k3.checkpoint.rundir``) saves, so cleaning up leftovers of an
interrupted save never touches another writer's files.

``find_checkpoint`` verifies the manifest; a checkpoint that fails verification is an error
naming the file (CheckpointCorrupt), never "no checkpoint", and nothing deletes it implicitly.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import random
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import torch

from k3.checkpoint.pretrained import load_checkpoint, save_pretrained
from k3.cliutil import describe_error
from k3.errors import CheckpointError
from k3.fsutil import fsync_path

__all__ = ["save_checkpoint", "find_checkpoint", "read_checkpoint", "has_checkpoint", "verify_checkpoint",
           "check_free_space", "pinned_checkpoint", "load_trainer_state", "rng_state", "set_rng_state", "save_model_weights",
           "load_model_weights", "CheckpointCorrupt", "CKPT_NAME", "MANIFEST"]

CKPT_NAME = "checkpoint"
_PREV = CKPT_NAME + ".prev"
_TMP_PREFIX = ".checkpoint-tmp-"
_LINK_PREFIX = ".checkpoint-link-"
_VERSION_PREFIX = "checkpoint-"
MANIFEST = "manifest.json"


class CheckpointCorrupt(CheckpointError):
    """A checkpoint folder that is incomplete or whose files do not match its manifest."""


# ------------------------------------------------------------------------------ model weights
def save_model_weights(model: torch.nn.Module, directory: Path) -> None:
    """config.json + HF-named safetensors (k3.checkpoint; fp32 kept as is, so reloading is exact)."""
    save_pretrained(model, directory)


def load_model_weights(model: torch.nn.Module, directory: Path) -> None:
    """Load weights saved by ``save_model_weights`` in place (validated before any copy)."""
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
def _versions(run_dir: Path) -> list[Path]:
    return sorted(p for p in run_dir.glob(_VERSION_PREFIX + "*") if p.is_dir() and not p.is_symlink())


def _pointer_target(run_dir: Path) -> Path | None:
    """The folder ``checkpoint`` names now: a symlink's target, a legacy real folder, or None."""
    link = run_dir / CKPT_NAME
    if link.is_symlink():
        return run_dir / os.readlink(link)
    if link.is_dir():
        return link
    return None


def _migrate_legacy(run_dir: Path) -> None:
    """Older runs kept ``checkpoint`` (and ``checkpoint.prev`` mid-commit) as real folders: give
    them version names so the pointer can be a symlink. Only a legacy commit's never-completed
    new folder (no manifest, with ``.prev`` beside it) is removed."""
    link, prev = run_dir / CKPT_NAME, run_dir / _PREV

    def adopt(p: Path, point: bool) -> None:
        v = run_dir / f"{_VERSION_PREFIX}legacy-{os.urandom(4).hex()}"
        os.rename(p, v)
        if point:
            os.symlink(v.name, link)

    if link.is_dir() and not link.is_symlink():
        if prev.is_dir() and not (link / MANIFEST).is_file():
            shutil.rmtree(link)
        else:
            adopt(link, True)
    if prev.is_dir():
        adopt(prev, not (link.exists() or link.is_symlink()))


def _drop_leftovers(run_dir: Path, keep: set[str]) -> None:
    """Remove temporary folders / links of interrupted saves and versions older than ``keep``.
    Only the lock holder (the one process that saves) calls this."""
    for p in run_dir.glob(_TMP_PREFIX + "*"):
        shutil.rmtree(p, ignore_errors=True)
    for p in run_dir.glob(_LINK_PREFIX + "*"):
        p.unlink(missing_ok=True)
    for v in _versions(run_dir):
        if v.name not in keep:
            _remove_unpinned(v)


def _remove_unpinned(version: Path) -> None:
    """Delete an old version unless a reader has it pinned (then a later save retries)."""
    try:
        fd = os.open(version / MANIFEST, os.O_RDONLY)
    except FileNotFoundError:  # an orphan of an interrupted save: nobody can be reading it
        shutil.rmtree(version, ignore_errors=True)
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return
    try:
        shutil.rmtree(version, ignore_errors=True)
    finally:
        os.close(fd)


def check_free_space(run_dir: Path, need_bytes: int) -> None:
    """CheckpointError unless the run's filesystem has room for ``need_bytes`` (+5% and 16 MiB;
    ``need_bytes=0`` checks nothing)."""
    free = shutil.disk_usage(run_dir).free
    want = int(need_bytes * 1.05) + (16 << 20 if need_bytes else 0)
    if free < want:
        raise CheckpointError(f"{run_dir}: not enough free space to write a checkpoint: needs about "
                              f"{want / 2**20:,.0f} MiB, {free / 2**20:,.0f} MiB free (the previous "
                              "checkpoint is intact)")


def save_checkpoint(run_dir: str | os.PathLike, step: int, write: Callable[[Path], None],
                    need_bytes: int = 0) -> Path:
    """Write a checkpoint: ``write(folder)`` fills a temporary folder, then commit (module docstring).

    If ``write`` (or anything before the commit) raises, the temporary folder is removed and the
    previous checkpoint stays current; an OS-level failure (read-only filesystem, no space) is
    re-raised as CheckpointError naming the run directory and the cause.
    """
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    _migrate_legacy(run_dir)
    old = _pointer_target(run_dir)
    _drop_leftovers(run_dir, {old.name} if old is not None else set())
    check_free_space(run_dir, need_bytes)
    tmp = Path(tempfile.mkdtemp(prefix=_TMP_PREFIX, dir=run_dir))
    version = run_dir / f"{_VERSION_PREFIX}{step:08d}-{os.urandom(4).hex()}"
    try:
        write(tmp)
        _write_manifest(tmp, step)
        for p in _files(tmp):
            fsync_path(p)
        for d in sorted({p.parent for p in tmp.rglob("*")} | {tmp}):
            fsync_path(d)
        os.rename(tmp, version)
        link_tmp = run_dir / f"{_LINK_PREFIX}{os.urandom(4).hex()}"
        os.symlink(version.name, link_tmp)
        os.replace(link_tmp, run_dir / CKPT_NAME)  # the commit point
        fsync_path(run_dir)
    except Exception as e:
        line = describe_error(e) if isinstance(e, (OSError, RuntimeError)) else None
        if line is not None and isinstance(e, RuntimeError) and shutil.disk_usage(run_dir).free < (1 << 20):
            line = "no space left on device"  # torch's zip writer reports a short write only
        shutil.rmtree(tmp, ignore_errors=True)
        if _pointer_target(run_dir) != version:
            shutil.rmtree(version, ignore_errors=True)
        if line is None:
            raise
        raise CheckpointError(f"{run_dir}: checkpoint of step {step} not saved: {line}; the "
                              "previous checkpoint is intact") from e
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    # keep the previous version too: a reader that resolved it just before the swap can finish
    _drop_leftovers(run_dir, {version.name} | ({old.name} if old is not None else set()))
    return version


def has_checkpoint(run_dir: str | os.PathLike) -> bool:
    """Whether ``run_dir`` holds anything that looks like a checkpoint (complete or not)."""
    run_dir = Path(run_dir)
    return any(p.exists() or p.is_symlink() for p in (run_dir / CKPT_NAME, run_dir / _PREV)) \
        or bool(_versions(run_dir))


def find_checkpoint(run_dir: str | os.PathLike) -> Path | None:
    """The run's current checkpoint folder (verified), or None when the run has none.

    A checkpoint that exists but fails verification raises CheckpointCorrupt naming the failing
    file: it is never treated as absent. If a concurrent save swaps the pointer while this
    verifies, the new target is verified instead (at most three tries).
    """
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return None
    for _ in range(3):
        target = _pointer_target(run_dir)
        if target is None:
            legacy = run_dir / _PREV
            if legacy.is_dir():  # a legacy commit interrupted between its renames
                verify_checkpoint(legacy)
                return legacy
            if _versions(run_dir):
                raise CheckpointCorrupt(f"{run_dir}: checkpoint folders {[v.name for v in _versions(run_dir)]} "
                                        f"but no {CKPT_NAME} pointer naming the current one")
            return None
        try:
            if not target.is_dir():
                raise CheckpointCorrupt(f"{run_dir / CKPT_NAME}: points to {target.name}, which is missing")
            verify_checkpoint(target)
            return target
        except CheckpointCorrupt:
            if _pointer_target(run_dir) == target:
                legacy = run_dir / _PREV
                if target == run_dir / CKPT_NAME and legacy.is_dir() and not (target / MANIFEST).exists():
                    verify_checkpoint(legacy)  # legacy: the new folder was incomplete, .prev is whole
                    return legacy
                raise
    raise CheckpointCorrupt(f"{run_dir}: the checkpoint kept changing while being read")


def _pin(version: Path) -> int | None:
    """A shared flock on the version's manifest while a reader loads it (the saver never deletes a
    pinned version); None if the version is already gone."""
    try:
        fd = os.open(version / MANIFEST, os.O_RDONLY)
    except FileNotFoundError:
        return None
    fcntl.flock(fd, fcntl.LOCK_SH)
    if not (version / MANIFEST).exists():  # deleted between our open and our lock
        os.close(fd)
        return None
    return fd


@contextmanager
def pinned_checkpoint(run_dir: str | os.PathLike) -> Iterator[Path]:
    """The run's current checkpoint folder, verified and pinned (not deleted by a concurrent save)
    for the duration of the ``with`` block. CheckpointError if the run holds none."""
    run_dir = Path(run_dir)
    for _ in range(10):
        target = _pointer_target(run_dir)
        if target is None or target == run_dir / CKPT_NAME:  # none, or a legacy real folder
            ckpt = find_checkpoint(run_dir)
            if ckpt is None:
                raise CheckpointError(f"{run_dir}: holds no checkpoint (expected a k3 run directory)")
            yield ckpt
            return
        fd = _pin(target)
        if fd is None:
            if _pointer_target(run_dir) == target:
                raise CheckpointCorrupt(f"{run_dir / CKPT_NAME}: points to {target.name}, which has no {MANIFEST}")
            continue  # rotated out before we pinned it: take the new current one
        try:
            verify_checkpoint(target)
            yield target
            return
        finally:
            os.close(fd)
    raise CheckpointCorrupt(f"{run_dir}: the checkpoint kept changing while being read")


def read_checkpoint(run_dir: str | os.PathLike, load: Callable[[Path], Any]) -> Any:
    """``load(folder)`` on the run's current checkpoint, pinned against concurrent saves."""
    with pinned_checkpoint(run_dir) as ckpt:
        return load(ckpt)


def load_trainer_state(ckpt: Path) -> dict[str, Any]:
    return torch.load(ckpt / "trainer_state.pt", map_location="cpu", weights_only=True)
