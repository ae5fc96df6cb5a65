"""Run directories: one owner at a time, and k3 never takes over a folder it did not create.

* Lock: ``<run>/.k3-run.lock`` holds an exclusive ``fcntl.flock`` for as long as a process
  trains (or resumes) in the run; the holder's PID is written into the file. A second process
  gets :class:`RunDirBusy` at once, naming that PID. The OS drops a flock when its process dies,
  so a lock file left by a killed process does not block anyone (the flock, not the file, is the
  lock). Within one process the lock is re-entrant (a count per directory).
* Marker: ``<run>/k3-run.json`` says which k3 command created the folder. A fresh run refuses a
  non-empty folder without it, and refuses a folder that holds a checkpoint (complete or
  failing verification) unless ``overwrite`` is given. ``k3 demo`` replaces only a folder whose
  marker says ``k3 demo``.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import time
from pathlib import Path

from k3.checkpoint.training import find_checkpoint, has_checkpoint, load_trainer_state
from k3.errors import K3Error
from k3.fsutil import atomic_write

__all__ = ["RunLock", "RunDirBusy", "claim_run_dir", "check_foreign_dir", "read_marker", "mark_resumed_run",
           "LOCK_NAME", "MARKER_NAME"]

LOCK_NAME = ".k3-run.lock"
MARKER_NAME = "k3-run.json"

_held: dict[str, list[int]] = {}  # realpath of the run dir -> [fd, count] for this process


class RunDirBusy(K3Error):
    """Another process holds the run directory's lock."""


class RunLock:
    """Exclusive, re-entrant (per process) flock on ``<run_dir>/.k3-run.lock``; a context manager."""

    def __init__(self, run_dir: str | os.PathLike):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK_NAME
        self._mine = False

    @property
    def key(self) -> str:
        return os.path.realpath(self.run_dir)

    def acquire(self) -> "RunLock":
        if self._mine:
            return self
        key = self.key
        if key in _held:
            _held[key][1] += 1
            self._mine = True
            return self
        if not self.run_dir.is_dir():
            raise K3Error(f"{self.run_dir}: no such run directory")
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode("ascii", "replace").strip() or "unknown"
            os.close(fd)
            raise RunDirBusy(f"{self.run_dir}: in use by another k3 process (PID {holder}, lock file "
                             f"{self.path}); wait for it to finish or stop it first") from None
        except BaseException:
            os.close(fd)
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        _held[key] = [fd, 1]
        self._mine = True
        return self

    def release(self) -> None:
        if not self._mine:
            return
        self._mine = False
        entry = _held.get(self.key)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            del _held[self.key]
            os.close(entry[0])  # closing the last descriptor drops the flock

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def read_marker(run_dir: str | os.PathLike) -> dict | None:
    """The marker's content; None when the folder has none (a ``DEMO`` file of older demos counts)."""
    path = Path(run_dir) / MARKER_NAME
    if not path.is_file():
        return {"created_by": "k3 demo"} if (Path(run_dir) / "DEMO").is_file() else None
    try:
        d = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return {"created_by": "unknown"}
    return d if isinstance(d, dict) else {"created_by": "unknown"}


def _contents(run_dir: Path) -> list[Path]:
    return [p for p in run_dir.iterdir() if p.name != LOCK_NAME]


def check_foreign_dir(run_dir: str | os.PathLike, flag: str = "--out") -> None:
    """K3Error if ``run_dir`` is a file, or a non-empty folder that k3 did not create."""
    run_dir = Path(run_dir)
    if run_dir.exists() and not run_dir.is_dir():
        raise K3Error(f"{flag} {run_dir}: exists and is not a directory")
    if run_dir.is_dir() and _contents(run_dir) and read_marker(run_dir) is None:
        raise K3Error(f"{flag} {run_dir}: exists, is not empty and is not a k3 run directory (no "
                      f"{MARKER_NAME}); k3 does not take over folders it did not create, choose another {flag}")


def _write_marker(run_dir: Path, info: dict) -> None:
    atomic_write(run_dir / MARKER_NAME, lambda f: f.write(json.dumps(info) + "\n"))


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")


def mark_resumed_run(run_dir: str | os.PathLike) -> None:
    """Give a run resumed from its checkpoint the marker if it has none (runs of older k3)."""
    if read_marker(run_dir) is None:
        _write_marker(Path(run_dir), {"created_by": "k3 train", "marked_on_resume": _now()})


def _clear(run_dir: Path) -> None:
    for p in _contents(run_dir):
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        else:
            p.unlink()


def claim_run_dir(run_dir: str | os.PathLike, created_by: str, overwrite: bool = False,
                  replace_same_kind: bool = False) -> None:
    """Prepare ``run_dir`` for a fresh run; the caller holds its RunLock.

    Refuses (K3Error): a non-empty folder without the k3 marker; a folder holding a checkpoint,
    unless ``overwrite`` (or ``replace_same_kind`` and the marker was written by ``created_by``).
    A marked folder is emptied (the marker kept) before the run starts; nothing else is deleted.
    """
    run_dir = Path(run_dir)
    check_foreign_dir(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    marker = read_marker(run_dir)
    same_kind = replace_same_kind and marker is not None and marker.get("created_by") == created_by
    if marker is not None and has_checkpoint(run_dir) and not (overwrite or same_kind):
        try:
            ckpt = find_checkpoint(run_dir)
            what = f"a checkpoint (step {load_trainer_state(ckpt)['step']})" if ckpt else "a checkpoint"
        except K3Error as e:
            what = f"a checkpoint that fails verification ({e})"
        raise K3Error(f"--out {run_dir}: already holds {what}; pass --resume {run_dir} to continue it, "
                      "--overwrite to replace it, or choose another --out")
    if marker is not None:
        _clear(run_dir)
    info = {"created_by": created_by, "pid": os.getpid(), "time": _now()}
    if marker is not None and not same_kind and marker.get("created_by") != "unknown":
        info = {**marker, "reused_by": created_by}
    _write_marker(run_dir, info)
