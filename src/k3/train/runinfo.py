"""What a run stores about its inputs so it can be resumed from anywhere and checked.

* ``absolute_paths(tc)``: ``data`` and ``model_config`` made absolute, so the stored train config
  (checkpoint and run.json) names the same files from any working directory.
* ``corpus_difference(saved_docs, corpus)``: which documents changed since the checkpoint, from
  the per-document digests stored in ``trainer_state.pt`` (``Corpus.doc_digests``).
* ``write_run_info(trainer, resumed_from)``: ``run.json`` (configs, corpus, code version, argv;
  one entry per resume).
* ``checkpoint_bytes(trainer)``: the bytes a checkpoint of this run needs (model + optimizer
  tensors + a small allowance for the tokenizer, trainer state and manifest), for the free-space
  check before a save.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from k3.fsutil import atomic_write
from k3.version import __version__

if TYPE_CHECKING:
    from k3.data.corpus import Corpus
    from k3.train.config import TrainConfig

__all__ = ["absolute_paths", "corpus_difference", "checkpoint_bytes", "write_run_info"]


def absolute_paths(tc: "TrainConfig") -> "TrainConfig":
    changes = {k: str(Path(v).expanduser().absolute()) for k in ("data", "model_config")
               if (v := getattr(tc, k)) is not None and not os.path.isabs(os.path.expanduser(v))}
    return tc.replace(**changes) if changes else tc


def _names(ids: list[str], n: int = 5) -> str:
    return ", ".join(ids[:n]) + (f" and {len(ids) - n} more" if len(ids) > n else "")


def corpus_difference(saved: dict[str, str] | None, corpus: "Corpus") -> str:
    """A message naming what differs between the checkpoint's corpus and ``corpus``."""
    head = f"the corpus ({corpus.name}) differs from the one the checkpoint was trained on"
    if saved is None:
        return head + " (the checkpoint predates per-document digests)"
    now = corpus.doc_digests()
    changed = sorted(k for k in saved.keys() & now.keys() if saved[k] != now[k])
    added, removed = sorted(now.keys() - saved.keys()), sorted(saved.keys() - now.keys())
    parts = [f"{label}: {_names(ids)}" for label, ids in
             (("changed", changed), ("added", added), ("removed", removed)) if ids]
    return head + ("; " + "; ".join(parts) if parts else " (same documents, different split)")


def _tensor_bytes(obj) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(v) for v in obj)
    return 0


def checkpoint_bytes(trainer) -> int:
    """Model tensors + optimizer state (at least two moments per parameter: before the first
    step the state is still empty) + 4 MiB for the small files."""
    model = sum(_tensor_bytes(t) for t in trainer.model.state_dict().values())
    params = sum(_tensor_bytes(p) for p in trainer.model.parameters())
    optim = _tensor_bytes(trainer.optimizer.state_dict()["state"])
    return model + max(optim, 2 * params) + (4 << 20)


def _git_commit() -> dict[str, Any]:
    import subprocess
    root = Path(__file__).resolve().parents[3]
    try:
        commit = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True,
                                text=True, timeout=10).stdout.strip() or None
        dirty = bool(subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--", "src"],
                                    capture_output=True, text=True, timeout=10).stdout.strip())
    except (OSError, subprocess.SubprocessError):
        return {"git_commit": None, "git_dirty": None}
    return {"git_commit": commit, "git_dirty": dirty if commit else None}


def _data_info(trainer) -> dict[str, Any]:
    """What run.json says about the data: the corpus and its token streams, or the SFT counts."""
    c = trainer.corpus
    info = {"name": c.name, "fingerprint": c.fingerprint}
    if hasattr(c, "counts"):  # SFT conversations (k3.data.sft.ChatData)
        return {**info, **c.counts()}
    return {**info, "train_tokens": len(trainer.train_tokens), "val_tokens": len(trainer.val_tokens),
            "val_bytes": c.val_bytes}


def write_run_info(trainer, resumed_from: int | None) -> None:
    """run.json: configs, corpus, code version and argv at the start; one entry per resume."""
    import json
    import platform
    import sys

    path = trainer.run_dir / "run.json"
    info = json.loads(path.read_text()) if resumed_from is not None and path.is_file() else {}
    now = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    code = {"k3_version": __version__, **_git_commit(), "python": platform.python_version(),
            "torch": torch.__version__}
    if resumed_from is None:
        info = {"train_config": trainer.tc.to_dict(), "model_config": trainer.model_config.to_text_dict(),
                "corpus": _data_info(trainer),
                **code, "argv": sys.argv, "started": now}
    else:
        info.setdefault("resumes", []).append({"step": resumed_from, "time": now,
                                               "train_config": trainer.tc.to_dict(), **code})
    atomic_write(path, lambda f: f.write(json.dumps(info, indent=2) + "\n"))
