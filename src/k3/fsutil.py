"""Atomic file writes: write to a temporary name in the same folder, fsync, then rename.

A reader (or a crash at any point) sees either the old file or the complete new one, never a
partial write. Used for caches (tokenizers, token streams) and run metadata; checkpoints build
their multi-file commit on the same rule in ``k3.checkpoint``.
"""

from __future__ import annotations

import errno
import os
import tempfile
from pathlib import Path
from typing import IO, Callable

__all__ = ["atomic_write", "fsync_path", "ensure_dir"]


def atomic_write(path: str | os.PathLike, write: Callable[[IO], None], binary: bool = False) -> None:
    """Create or replace ``path`` with what ``write(f)`` writes to an open file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb" if binary else "w", **({} if binary else {"encoding": "utf-8"})) as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp makes 0600; caches and run folders are shared
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def ensure_dir(path: str | os.PathLike) -> Path:
    """``mkdir -p``; a file where a directory belongs is NotADirectoryError naming it (mkdir alone
    says "File exists")."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise NotADirectoryError(errno.ENOTDIR, "not a directory", str(path))
    path.mkdir(parents=True, exist_ok=True)
    return path


def fsync_path(path: str | os.PathLike) -> None:
    """fsync a file, or a directory (so renames inside it are durable). Platforms that cannot
    open a directory skip the directory case."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        if os.path.isdir(path):
            return
        raise
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
