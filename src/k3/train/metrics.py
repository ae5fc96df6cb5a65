"""Run metrics: JSONL log, progress display (tqdm on a terminal, plain lines otherwise), loss plot.

``metrics.jsonl`` holds one JSON object per line with a ``kind``:

* ``train``: step, loss, lr, seq_len, tokens, tokens_per_s, grad_norm, load_cv (mean over MoE
  layers), load_cv_layers, load_max_over_mean (max over layers);
* ``skip``: step, reason (a step whose loss or gradients were not finite);
* ``val``: step, val_loss (nats/token), val_bpb (bits per UTF-8 byte), val_tokens, val_bytes.

Bits per byte = Σ token losses (nats) / ln 2 / bytes of the predicted text, i.e.
val_loss · tokens / bytes / ln 2.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any, Iterable

from k3.fsutil import ensure_dir

__all__ = ["MetricsLog", "MemoryMetrics", "Progress", "read_metrics", "plot_run", "METRICS_NAME", "PLOT_NAME"]

METRICS_NAME = "metrics.jsonl"
PLOT_NAME = "loss.png"


def _json_safe(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)  # JSON has no NaN/Inf
    return v


class MetricsLog:
    """Append-only JSONL writer; ``records`` keeps everything logged so far (saved in checkpoints)."""

    def __init__(self, run_dir: str | os.PathLike, records: Iterable[dict] = ()):
        self.path = Path(run_dir) / METRICS_NAME
        self.records: list[dict] = list(records)
        # Rewrite from the given records: after a resume, lines logged past the checkpoint go away.
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "w") as f:
            for r in self.records:
                f.write(json.dumps(r) + "\n")

    def log(self, kind: str, **fields: Any) -> dict:
        rec = {"kind": kind, **{k: _json_safe(v) for k, v in fields.items()}}
        self.records.append(rec)
        with open(self.path, "a") as f:
            f.write(json.dumps(rec) + "\n")
        return rec


class MemoryMetrics:
    """The records of a process that writes no file (a distributed run's ranks other than 0: rank 0
    writes metrics.jsonl); the same ``log`` and ``records``."""

    def __init__(self, records: Iterable[dict] = ()):
        self.records: list[dict] = list(records)

    def log(self, kind: str, **fields: Any) -> dict:
        rec = {"kind": kind, **{k: _json_safe(v) for k, v in fields.items()}}
        self.records.append(rec)
        return rec


def read_metrics(run_dir: str | os.PathLike) -> list[dict]:
    path = Path(run_dir) / METRICS_NAME
    if not path.is_file():
        raise FileNotFoundError(f"no {METRICS_NAME} in {run_dir} (is it a k3 training run?)")
    out = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                raise ValueError(f"{path}:{n}: not valid JSON") from None
    return out


def _fmt_time(s: float) -> str:
    s = int(max(s, 0))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60:d}:{s % 60:02d}"


class Progress:
    """A tqdm bar (loss, tokens/s, ETA) on a terminal; one plain line every ``log_interval`` else."""

    def __init__(self, total: int, start: int, log_interval: int, tty: bool | None = None,
                 stream=None):
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty() if tty is None else tty
        self.total, self.step, self.log_interval = total, start, log_interval
        self.t0, self.start = time.perf_counter(), start
        self.bar = None
        if self.tty:
            from tqdm import tqdm
            self.bar = tqdm(total=total, initial=start, file=self.stream, unit="step",
                            dynamic_ncols=True, smoothing=0.1)

    def eta(self) -> float:
        done = self.step - self.start
        if done <= 0:
            return float("nan")
        return (time.perf_counter() - self.t0) / done * (self.total - self.step)

    def update(self, step: int, loss: float | None, tokens_per_s: float, extra: str = "") -> None:
        self.step = step
        if self.bar is not None:
            self.bar.update(step - self.bar.n)
            post = {"loss": f"{loss:.3f}" if loss is not None else "skip", "tok/s": f"{tokens_per_s:,.0f}"}
            self.bar.set_postfix(post, refresh=False)
        elif step % self.log_interval == 0 or step == self.total:
            ls = f"{loss:.4f}" if loss is not None else "skipped"
            self.write(f"step {step}/{self.total}  loss {ls}  {tokens_per_s:,.0f} tok/s  "
                       f"eta {_fmt_time(self.eta())}{('  ' + extra) if extra else ''}")

    def write(self, msg: str) -> None:
        if self.bar is not None:
            self.bar.write(msg, file=self.stream)
        else:
            print(msg, file=self.stream, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def plot_run(run_dir: str | os.PathLike, out: str | os.PathLike | None = None) -> Path:
    """Write a PNG: train/val loss, val bits per byte (an RL run: its reward curve), expert-load CV
    against step."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs = read_metrics(run_dir)
    train = [r for r in recs if r.get("kind") == "train"]
    val = [r for r in recs if r.get("kind") == "val"]
    if not train and not val:
        raise ValueError(f"{run_dir}: {METRICS_NAME} has no training records to plot")
    out = Path(out) if out is not None else Path(run_dir) / PLOT_NAME
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    ax = axes[0]
    ax.plot([r["step"] for r in train], [r["loss"] for r in train], lw=0.8, label="train")
    if val:
        ax.plot([r["step"] for r in val], [r["val_loss"] for r in val], "o-", label="validation")
    ax.set(xlabel="step", ylabel="loss (nats/token)", title="loss")
    ax.legend()
    ax = axes[1]
    rl = [r for r in recs if r.get("kind") == "rl" and r.get("reward_mean") is not None]
    if rl:  # an RL run (k3 rl): the reward curve instead of validation
        ax.plot([r["step"] for r in rl], [r["reward_mean"] for r in rl], "o-", ms=3, label="mean reward")
        ax.plot([r["step"] for r in rl], [r["pass_rate"] for r in rl], "s--", ms=3, label="pass rate")
        ax.set(xlabel="step", ylabel="reward", title="rollout reward (hidden verifier)", ylim=(-0.05, 1.05))
        ax.legend()
    else:
        if val:
            ax.plot([r["step"] for r in val], [r["val_bpb"] for r in val], "o-", color="C1")
        ax.set(xlabel="step", ylabel="bits per byte", title="validation bits per byte")
    ax = axes[2]
    cv = [r for r in train if r.get("load_cv_layers")]
    if cv:
        n = len(cv[0]["load_cv_layers"])
        for i in range(n):
            ax.plot([r["step"] for r in cv], [r["load_cv_layers"][i] for r in cv], lw=0.6, alpha=0.6)
        ax.plot([r["step"] for r in cv], [r["load_cv"] for r in cv], color="k", lw=1.4, label="mean")
        ax.legend()
    ax.set(xlabel="step", ylabel="CV of tokens per expert", title="expert load CV (per MoE layer)")
    for a in axes:
        a.grid(alpha=0.3)
    fig.suptitle(str(Path(run_dir).name))
    fig.tight_layout()
    ensure_dir(out.parent)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
