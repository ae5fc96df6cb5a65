"""SFT data from task families (``k3 task synth``): generate, solve in real sandboxes, keep what passed.

``synthesize(family, seeds, efforts, out)``: for each seed the family's task is generated (into
``tasks_dir``, or a temporary folder), and for each effort its scripted solver is run through the
real harness and sandbox (``k3.rl.rollout.rollout`` jobs: canonical harness, the effort recorded;
tool results are real, verification is the clean-room verifier). An episode is kept only when it
scored 1.0 and every tool result is the one the solver's later turns assume
(``Family.check_outputs``); each kept episode is one SFT row (``k3.rl.trajectory.to_chat``, meta:
family, domain, seed, split, task, reward, effort) on one line of ``out``. With ``per_turn=m``
the harness runs at ``context_tokens`` (its compaction on) and an episode gives one row per m-th
turn instead: what that turn was sent, compacted, then the turn, the only one trained
(``to_turn_chats``; meta adds ``turn``), so a model learns to act from compacted contexts.
``harness_seeds`` (with ``per_turn``): episode (seed, effort j) runs under the randomized harness
of seed ``harness_seeds[(seed * len(efforts) + j) % len(harness_seeds)]`` (tool and argument
names, prompt template, context strategy, memory note), so the rows teach every exam room
rather than one; ``meta`` adds ``harness``. ``rows`` counts rows, ``episodes`` episodes.
Everything else is reported with its reason. Rows come in seed order, efforts in the order given.
``out`` is written whole to a temporary file and then renamed into place.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

from k3.errors import ConfigError
from k3.rl.rollout import run_jobs
from k3.rl.trajectory import read_trajectory, to_chat, to_turn_chats
from k3.tasks.families import EFFORTS, get_family, read_meta

__all__ = ["synthesize", "SynthReport", "parse_seeds", "parse_efforts", "MAX_SEEDS"]

MAX_SEEDS = 1_000_000
CHUNK = 64  # seeds generated, run and converted at a time (keeps the temporary folder small)


def parse_seeds(text: str, flag: str = "--seeds") -> range:
    """``A:B`` -> seeds A, A+1, ..., B-1 (half-open, 0 <= A < B); ``N`` -> just N; errors name ``flag``."""
    a, sep, b = str(text).partition(":")
    try:
        lo = int(a)
        hi = int(b) if sep else lo + 1
    except ValueError:
        lo = hi = -1
    if lo < 0 or hi <= lo:
        raise ConfigError(f"{flag} must be A:B with 0 <= A < B (seeds A..B-1) or one seed N >= 0, got {text!r}")
    if hi - lo > MAX_SEEDS:
        raise ConfigError(f"{flag} {text!r} names {hi - lo} seeds; at most {MAX_SEEDS} per run")
    return range(lo, hi)


def parse_efforts(values: list[str] | None) -> list[str]:
    """``--effort`` values (repeatable; ``all`` = low, high, max), deduplicated in order."""
    out: list[str] = []
    for v in values or ["all"]:
        for e in (EFFORTS if v == "all" else [v]):
            if e not in EFFORTS:
                raise ConfigError(f"--effort must be one of {', '.join(EFFORTS)} or all, got {v!r}")
            if e not in out:
                out.append(e)
    return out


@dataclass
class SynthReport:
    out: Path
    rows: int = 0
    episodes: int = 0
    failed: list[tuple[str, str, str]] = field(default_factory=list)   # (task, effort, reason)


def synthesize(family: str, seeds: range, efforts: list[str], out, *, tasks_dir=None, backend: str = "namespace",
               workers: int = 1, overwrite: bool = False, per_turn: int | None = None,
               context_tokens: int | None = None, harness_seeds: Sequence[int] | None = None,
               log: Callable[[str], None] = lambda s: None) -> SynthReport:
    """Write the SFT rows of ``family`` x ``seeds`` x ``efforts`` to ``out`` (module doc)."""
    from k3.tasks.verify import Sandboxes

    for name, v in (("per_turn", per_turn), ("context_tokens", context_tokens)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise ConfigError(f"{name} must be an int >= 1, got {v!r}")
    if per_turn is None and (context_tokens is not None or harness_seeds is not None):
        raise ConfigError("context_tokens (--context-tokens) and harness_seeds (--harness-seeds) need per_turn "
                          "(--per-turn): a compacted context, or a randomized harness's memory note, is sent "
                          "differently each turn, so an episode is no single conversation")
    if harness_seeds is not None:
        harness_seeds = list(harness_seeds)
        if not harness_seeds or any(isinstance(h, bool) or not isinstance(h, int) for h in harness_seeds):
            raise ConfigError(f"harness_seeds must be a non-empty list of ints, got {harness_seeds!r}")
    fam = get_family(family)
    out = Path(out)
    if out.exists() and (out.is_dir() or out.stat().st_size) and not overwrite:
        raise ConfigError(f"{out}: exists (--overwrite replaces it)")
    Sandboxes(backend).close()  # refuses a backend now; builds the base image before workers race for it
    rep = SynthReport(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp_out = out.with_name(f".{out.name}.tmp{os.getpid()}")
    try:
        with tempfile.TemporaryDirectory(prefix="k3-synth-") as tmp, open(tmp_out, "w", encoding="utf-8") as f:
            root = Path(tmp)
            tasks_root = Path(tasks_dir) if tasks_dir else root / "tasks"
            for i in range(0, len(seeds), CHUNK):
                chunk = seeds[i:i + CHUNK]
                jobs = _jobs(fam, chunk, efforts, tasks_root, root, backend, context_tokens, harness_seeds)
                for job, res in zip(jobs, run_jobs(jobs, workers=workers)):
                    rep.episodes += 1
                    rows, why = _rows(fam, job, res, per_turn)
                    if rows is None:
                        rep.failed.append((Path(job["task"]).name, job["label"], why))
                        log(f"FAIL {Path(job['task']).name} {job['label']}: {why}")
                    else:
                        for row in rows:
                            f.write(json.dumps(row, ensure_ascii=False) + "\n")
                        rep.rows += len(rows)
                    Path(job["out"]).unlink(missing_ok=True)
                if not tasks_dir:
                    shutil.rmtree(tasks_root, ignore_errors=True)
                log(f"{fam.name}: {min(i + CHUNK, len(seeds))}/{len(seeds)} seeds, {rep.rows} rows, "
                    f"{len(rep.failed)} failed")
    except BaseException:
        tmp_out.unlink(missing_ok=True)
        raise
    os.replace(tmp_out, out)
    return rep


def _jobs(fam, seeds, efforts, tasks_root: Path, root: Path, backend: str, context_tokens: int | None,
          harness_seeds: list[int] | None) -> list[dict]:
    jobs = []
    for seed in seeds:
        d = fam.generate(seed, tasks_root, overwrite=True)  # only ever replaces a generated task
        for j, e in enumerate(efforts):
            harness = None if harness_seeds is None else harness_seeds[(seed * len(efforts) + j) % len(harness_seeds)]
            tr = root / "transcripts" / f"{d.name}.{e}.json"
            tr.parent.mkdir(parents=True, exist_ok=True)
            tr.write_text(json.dumps({"description": f"{fam.name} solver, effort {e}", "expect_reward": 1.0,
                                      "turns": fam.solve(d, e)}), encoding="utf-8")
            jobs.append({"task": str(d), "provider": {"kind": "scripted", "transcript": str(tr)}, "seed": None,
                         "harness": harness,
                         "backend": backend, "out": str(root / "traj" / f"{d.name}.{e}.jsonl"), "label": e,
                         "sampling": {"effort": e} if context_tokens is None else
                         {"effort": e, "context_tokens": context_tokens}})
    return jobs


def _rows(fam, job: dict, res: dict, per_turn: int | None) -> tuple[list[dict] | None, str]:
    if res["status"] == "error":
        return None, f"error: {res.get('detail')}"
    if res["score"] < 1.0:
        reasons = "; ".join(v["reason"] for v in res.get("verdicts", [])) or "no verdict"
        return None, f"score {res['score']} ({res['status']}): {reasons}"
    recs = read_trajectory(job["out"])
    meta = read_meta(job["task"])
    outputs = [r["result"]["output"] for r in recs if r["type"] == "tool"]
    why = fam.check_outputs(meta["spec"], job["label"], outputs)
    if why:
        return None, f"inconsistent: {why}"
    row_meta = {"family": fam.name, "domain": fam.domain, "seed": meta["seed"], "split": meta["split"],
                "effort": job["label"]}
    if job.get("harness") is not None:
        row_meta["harness"] = job["harness"]
    if per_turn is not None:
        return to_turn_chats(recs, row_meta, every=per_turn), ""
    return [to_chat(recs, row_meta)], ""

