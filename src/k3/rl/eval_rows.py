"""Evaluation result rows (SPEC §11): every score carries its conditions.

A run of ``k3 eval`` is a directory: ``run.json`` (suite, command line, defaults used, start and end
time) and ``rows.jsonl``, one JSON object per measured value::

    {"suite": "agent", "item": "fix-calc", "sample": 0, "metric": "score", "value": 1.0,
     "labels": {"family": "starter", "effort": "max", "harness": null},
     "conditions": {"model": {...}, "harness": {...}, "tools": {...}, "prompt": {...}, "budget": {...},
                    "effort": "max", "temperature": 1.0, "seeds": {...}, "setup": {...}},
     "k3_version": "0.1.0", "machine": "...", "date": "2026-12-05", "wall_s": 12.3, "tokens": 1234}

``conditions`` must hold every key of ``CONDITIONS``; a key that does not apply to a suite (the
harness of a bits-per-byte score) is present as ``null``, so "not applicable" is stated, never
implied by absence. ``model`` is ``{"kind": "checkpoint", "name", "fingerprint"}`` (sha256 over the
model's config, weights and tokenizer files), ``{"kind": "endpoint", "base_url", "model"}``, or
``{"kind": "scripted", "name"}`` (a workload's reference solution: the positive control).
``tools`` and ``prompt`` hold names, the template index and sha256 digests of what was sent (the
trajectory, kept beside the rows, has the full text). ``setup`` holds what else the suite's score
depends on (data fingerprint and sequence length for bpb; context length, depth and kind for
retrieval; threads for latency). ``labels`` are the row's grouping keys for tables. An optional
``detail`` holds what the value was read from (the model's output for retrieval, the error of an
episode that failed before it could be scored).

``read_rows`` refuses a row without its conditions, naming the file, line and missing key.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path

from k3.errors import ConfigError, K3Error
from k3.train.config import init_model_dir
from k3.version import __version__

__all__ = ["CONDITIONS", "ROW_KEYS", "EvalRun", "check_row", "read_rows", "model_condition", "endpoint_condition",
           "machine", "digest", "RowWriter"]

CONDITIONS = ("model", "harness", "tools", "prompt", "budget", "effort", "temperature", "seeds", "setup")
ROW_KEYS = ("suite", "item", "sample", "metric", "value", "labels", "conditions", "k3_version", "machine", "date",
            "wall_s", "tokens")
ROWS, RUN = "rows.jsonl", "run.json"


def digest(obj) -> str:
    """sha256 (first 16 hex digits) of a JSON value, keys sorted."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, ensure_ascii=False).encode()).hexdigest()[:16]


def machine() -> str:
    """The CPU model and core count (the machine a timing or a row was measured on)."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} cores"


def model_condition(path: str | os.PathLike) -> dict:
    """A checkpoint as a condition: its name and the sha256 of its model files (config, weights,
    index, tokenizer), read from the resolved checkpoint folder of a run, checkpoint or model dir."""
    init = init_model_dir(str(path))
    h = hashlib.sha256()
    files = sorted(p for p in init.model.iterdir() if p.is_file()) + [init.tokenizer]
    for p in files:
        h.update(p.name.encode() + b"\0")
        with open(p, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    return {"kind": "checkpoint", "name": Path(path).resolve().name, "fingerprint": h.hexdigest()[:16]}


def endpoint_condition(base_url: str, model: str) -> dict:
    return {"kind": "endpoint", "base_url": base_url.rstrip("/"), "model": model}


def check_row(row, where: str = "row") -> dict:
    """``row`` when it has every key of ``ROW_KEYS`` and every condition, else a K3Error naming the gap."""
    if not isinstance(row, dict):
        raise K3Error(f"{where}: an evaluation row is a JSON object, got {type(row).__name__}")
    missing = [k for k in ROW_KEYS if k not in row]
    if missing:
        raise K3Error(f"{where}: the row has no {', '.join(missing)} (every row carries its conditions)")
    cond = row["conditions"]
    if not isinstance(cond, dict):
        raise K3Error(f"{where}: 'conditions' must be an object")
    missing = [k for k in CONDITIONS if k not in cond]
    if missing:
        raise K3Error(f"{where}: conditions lack {', '.join(missing)} (state a condition that does not "
                      "apply as null)")
    if not isinstance(cond["model"], dict) or cond["model"].get("kind") not in ("checkpoint", "endpoint", "scripted"):
        raise K3Error(f"{where}: conditions.model must name a checkpoint (fingerprint), an endpoint or a "
                      "scripted reference")
    v = row["value"]
    if v is not None and not isinstance(v, (int, float)):
        raise K3Error(f"{where}: value must be a number or null, got {v!r}")
    if not isinstance(row["labels"], dict):
        raise K3Error(f"{where}: 'labels' must be an object")
    return row


def read_rows(path: str | os.PathLike) -> list[dict]:
    """Every row of a rows.jsonl (or of ``DIR/rows.jsonl``), each checked by ``check_row``."""
    p = Path(path)
    if p.is_dir():
        p = p / ROWS
    if not p.is_file():
        raise ConfigError(f"{path}: no evaluation rows here (expected {ROWS} or a k3 eval --out folder)")
    rows = []
    for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:
            raise K3Error(f"{p}:{n}: not a JSON line") from None
        rows.append(check_row(row, f"{p}:{n}"))
    if not rows:
        raise K3Error(f"{p}: no rows")
    return rows


class RowWriter:
    """Appends checked rows to ``out/rows.jsonl`` (flushed per row); fills the common fields."""

    def __init__(self, out: Path, suite: str):
        self.out, self.suite = out, suite
        self.common = {"k3_version": __version__, "machine": machine(), "date": time.strftime("%Y-%m-%d")}
        out.mkdir(parents=True, exist_ok=True)
        self.rows: list[dict] = []
        self._f = open(out / ROWS, "a", encoding="utf-8")

    def write(self, item: str, metric: str, value, conditions: dict, labels: dict | None = None, sample: int = 0,
              wall_s: float = 0.0, tokens: int = 0, detail: dict | None = None) -> dict:
        """One row; ``detail`` (optional) holds what the value was read from (a model's output)."""
        row = check_row({"suite": self.suite, "item": item, "sample": sample, "metric": metric, "value": value,
                         "labels": dict(labels or {}), "conditions": conditions, **self.common,
                         "wall_s": round(float(wall_s), 4), "tokens": int(tokens)}, f"{self.suite} row")
        if detail:
            row["detail"] = detail
        self._f.write(json.dumps(row, ensure_ascii=False) + "\n")
        self._f.flush()
        self.rows.append(row)
        return row

    def close(self) -> None:
        self._f.close()


@dataclass
class EvalRun:
    """One ``k3 eval`` output folder: its rows and its run.json."""
    path: Path
    rows: list[dict]
    info: dict

    @classmethod
    def load(cls, path: str | os.PathLike) -> "EvalRun":
        p = Path(path)
        rows = read_rows(p)
        info_path = (p if p.is_dir() else p.parent) / RUN
        info = json.loads(info_path.read_text()) if info_path.is_file() else {}
        return cls(p, rows, info)

    @property
    def name(self) -> str:
        return self.path.name if self.path.is_dir() else self.path.parent.name

    @property
    def suites(self) -> list[str]:
        return sorted({r["suite"] for r in self.rows})
