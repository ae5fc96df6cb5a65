"""``k3 sft`` (SPEC §10): supervised fine-tuning on conversations and on passing trajectories.

The trainer is ``k3 train``'s (``k3.train.loop.Trainer``, resumable bit-exactly, torchrun with
``--nproc``); what differs is the data: ``--data`` names chat JSONL files (``k3.data.sft``) and/or
trajectories written by ``k3 task run`` / ``k3 task suite`` (a JSONL file whose first record is a
``header``). A trajectory becomes the conversation its model saw (``k3.rl.trajectory.to_chat``) and
is kept only when its episode scored 1.0 (the hidden verifier passed it), unless
``--include-failed``; a dropped trajectory is reported, never silently lost.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterator

from k3.data.sft import SFTError, jsonl_files, read_chat_file

__all__ = ["SFTRows", "is_trajectory", "PASS_SCORE"]

PASS_SCORE = 1.0  # an episode's score (the best or last verified reward) that counts as passed


def is_trajectory(path: Path) -> bool:
    """A trajectory JSONL starts with a ``header`` record; a chat JSONL with a ``messages`` row."""
    try:
        with open(path, encoding="utf-8") as f:
            first = next((line for line in f if line.strip()), "")
        rec = json.loads(first)
    except (OSError, ValueError, UnicodeDecodeError):
        return False
    return isinstance(rec, dict) and rec.get("type") == "header" and "messages" not in rec


def _trajectory_row(path: Path, include_failed: bool):
    """The chat row of one trajectory, None when it did not pass (and failed ones are excluded),
    or an SFTError naming the file."""
    from k3.errors import K3Error
    from k3.rl.trajectory import read_trajectory, to_chat

    try:
        records = read_trajectory(path)
    except K3Error as e:
        return SFTError(str(e))
    end = next((r for r in records if r.get("type") == "end"), None)
    if end is None:
        return SFTError(f"{path}: the trajectory has no 'end' record (an episode still running, or cut short)")
    score = end.get("score")
    if not isinstance(score, (int, float)):
        return SFTError(f"{path}: end.score must be a number, got {score!r}")
    if score < PASS_SCORE and not include_failed:
        return None
    try:
        return to_chat(records)
    except K3Error as e:
        return SFTError(f"{path}: {e}")


class SFTRows:
    """The ``read_rows`` of an SFT run: ``(where, row)`` of every chat row and every passing
    trajectory under a path (files in sorted order); trajectories left out because they did not
    pass are listed in ``failed``."""

    def __init__(self):
        self.failed: list[str] = []

    def __call__(self, path: str | os.PathLike, include_failed: bool = False) -> Iterator[tuple[str, Any]]:
        self.failed = []
        for f in jsonl_files(path):
            if not is_trajectory(f):
                yield from read_chat_file(f)
                continue
            row = _trajectory_row(f, include_failed)
            if row is None:
                self.failed.append(str(f))
                continue
            yield str(f), row
