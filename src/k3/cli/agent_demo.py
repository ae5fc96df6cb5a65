"""``k3 agent-demo`` (``make agent-demo``): a pretrained tiny K3 becomes a (small) agent by SFT.

1. **Base**: a pretrained tiny K3 (``--base``, default ``runs/agent-base``); when it holds no
   checkpoint, ``k3 demo``'s code pretrains it with ``AGENT_BASE_CONFIG`` (the demo's recipe before
   issue 36: width 256, 4.2M parameters; the text demo is now a smaller model tuned for 10 minutes).
2. **Data**: every family of ``k3.tasks.families`` (general: ``arith``; general agent: ``files``;
   coding agent: ``code``) × low / high / max, on training seeds, through the family's scripted
   solver in the real harness and sandboxes (``k3.rl.synth``): tool results are real, and only
   episodes the hidden verifier passed become SFT conversations. With ``--harness-seeds A:B`` each
   episode runs under one of those randomized harnesses instead (tool and argument names, prompt
   template, context strategy, memory note), one SFT row per turn (``k3 task synth --per-turn 1``).
3. **SFT**: ``k3 sft`` of the base on those conversations (the one Trainer; packed rows).
4. **Held-out evaluation**: fresh seeds (``HELDOUT_START`` on), each family × effort, through the
   real harness and sandboxes with the ``LocalEngine`` provider, greedy; the base checkpoint on
   the same tasks at one effort as the control. Per cell: pass rate (score 1.0), and over every
   assistant turn the share that is well formed (closed thinking, ended by ``<|im_end|>``, every
   tool call a known tool with JSON-object arguments).

The report (a table, ``OUT/report.json`` and one JSON line per cell appended to
``benchmarks/results/agent_demo.jsonl``, each with the machine and date) gives the numbers the
README and docs quote.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from k3.rl.eval_rows import machine

__all__ = ["agent_demo_main", "AgentDemo", "ensure_base", "episode_stats", "evaluate_heldout", "fine_tune",
           "local_job", "machine"]

REPO = Path(__file__).resolve().parents[3]
SFT_STEPS, SFT_BATCH, SFT_LR = 300, 8, 3e-3   # the agent demo's SFT recipe (rows of 1024 tokens)
TRAIN_SEEDS = {"arith": 600, "files": 100, "code": 100}   # its training seeds 0..n-1 per family


@dataclass
class AgentDemo:
    base: Path
    out: Path
    train_seeds: dict[str, int]       # family -> training seeds 0..n-1
    heldout: int                      # held-out tasks per family × effort
    control: int                      # held-out tasks per family for the base checkpoint
    steps: int
    batch_size: int
    seq_len: int
    lr: float
    workers: int
    max_tokens: int
    threads: int | str
    results: Path | None = REPO / "benchmarks" / "results" / "agent_demo.jsonl"  # JSON lines appended
    harness_seeds: Sequence[int] | None = None  # SFT episodes under these randomized harnesses, one row per turn

    def run(self, log=print) -> dict:
        from k3.tasks.families import FAMILIES

        t_all = time.monotonic()
        times: dict[str, float] = {}
        self.out.mkdir(parents=True, exist_ok=True)
        t0 = time.monotonic()
        if ensure_base(self.base, log):
            times["pretrain_s"] = time.monotonic() - t0
        log(f"== synthesizing SFT conversations ({', '.join(f'{f}: {n} seeds' for f, n in self.train_seeds.items())} × 3 efforts)")
        t0 = time.monotonic()
        data = self.out / "data"
        from k3.rl.synth import synthesize
        from k3.tasks.families import EFFORTS
        for fam in FAMILIES:
            rep = synthesize(fam, range(self.train_seeds[fam]), list(EFFORTS), data / f"{fam}.jsonl",
                             workers=self.workers, overwrite=True, harness_seeds=self.harness_seeds,
                             per_turn=None if self.harness_seeds is None else 1)
            log(f"   {fam}: {rep.rows} conversations from {rep.episodes} episodes ({len(rep.failed)} failed)")
        times["synth_s"] = time.monotonic() - t0

        log(f"== SFT: {self.steps} steps of {self.batch_size} × {self.seq_len} tokens from {self.base}")
        t0 = time.monotonic()
        res, counts = fine_tune(self.base, data, self.out / "sft", self.steps, self.batch_size, self.lr,
                                self.threads, seq_len=self.seq_len, val_percent=2, log_interval=20, log=log)
        times["sft_s"] = time.monotonic() - t0
        log(f"   final val loss {res.val['val_loss']:.3f}" if res.val else "   (no validation split)")

        log(f"== held-out evaluation: {self.heldout} tasks per family × effort, LocalEngine, greedy")
        t0 = time.monotonic()
        cells = self.evaluate(self.out / "sft", EFFORTS, self.heldout, "sft")
        times["eval_s"] = time.monotonic() - t0
        t0 = time.monotonic()
        cells += self.evaluate(self.base, ("max",), self.control, "base")
        times["control_s"] = time.monotonic() - t0
        times["total_s"] = time.monotonic() - t_all
        report = {"cells": cells, "times": {k: round(v, 1) for k, v in times.items()},
                  "sft": {"steps": self.steps, "batch_size": self.batch_size, "seq_len": self.seq_len,
                          "lr": self.lr, **counts,
                          "harness_seeds": None if self.harness_seeds is None else
                          [self.harness_seeds[0], self.harness_seeds[-1]],
                          "final_val_loss": res.val["val_loss"] if res.val else None},
                  "machine": machine(), "date": time.strftime("%Y-%m-%d")}
        (self.out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
        if self.results is not None:
            _append_results(report, self.results)
        log(format_table(report))
        return report

    def evaluate(self, ckpt: Path, efforts, n: int, model: str) -> list[dict]:
        return evaluate_heldout(ckpt, self.out, efforts, n, model, self.workers, self.max_tokens)


def evaluate_heldout(ckpt: Path, out: Path, efforts, n: int, model: str, workers: int, max_tokens: int,
                     harness: int | None = None, families=None) -> list[dict]:
    """Held-out pass rates of ``ckpt``: the first ``n`` held-out seeds of every family (of
    ``families``, default all) × effort, LocalEngine, greedy, through the real harness (the
    canonical one, or randomized with seed ``harness``) and sandboxes; one cell per family × effort.
    Tasks go to ``out/heldout``, trajectories to ``out/eval/<model>[-h<harness>]/``."""
    from k3.rl.rollout import run_jobs
    from k3.tasks.families import FAMILIES, HELDOUT_START, get_family

    families = list(FAMILIES) if families is None else list(families)
    tasks = out / "heldout"
    where = out / "eval" / (model if harness is None else f"{model}-h{harness}")
    jobs = []
    for fam in families:
        f = get_family(fam)
        for seed in range(HELDOUT_START, HELDOUT_START + n):
            d = f.generate(seed, tasks, overwrite=True)
            for e in efforts:
                jobs.append(local_job(d, ckpt, where / f"{d.name}.{e}.jsonl", f"{fam}/{e}", e, 0.0, max_tokens,
                                      harness=harness))
    results = run_jobs(jobs, workers=workers)
    cells = []
    for fam in families:
        for e in efforts:
            mine = [(j, r) for j, r in zip(jobs, results) if j["label"] == f"{fam}/{e}"]
            stats = [episode_stats(j["out"]) for j, _ in mine]
            turns = sum(s["turns"] for s in stats)
            cells.append({"model": model, "family": fam, "domain": get_family(fam).domain, "effort": e,
                          "harness": harness, "tasks": len(mine), "passed": sum(r["score"] >= 1.0 for _, r in mine),
                          "pass_rate": sum(r["score"] >= 1.0 for _, r in mine) / max(len(mine), 1),
                          "turns": turns, "well_formed": sum(s["well_formed"] for s in stats),
                          "well_formed_rate": sum(s["well_formed"] for s in stats) / max(turns, 1),
                          "tool_calls": sum(s["tool_calls"] for s in stats),
                          "reasoning_chars": sum(s["reasoning_chars"] for s in stats) / max(len(stats), 1),
                          "errors": [r.get("detail") for _, r in mine if r["status"] == "error"][:3]})
    return cells


def local_job(task: Path, ckpt: Path, out: Path, label: str, effort: str, temperature: float, max_tokens: int,
              seed: int | None = None, harness: int | None = None) -> dict:
    """One ``run_jobs`` episode of ``task`` by the checkpoint ``ckpt`` in process (``LocalEngine``),
    in the namespace sandbox, its trajectory written to ``out``."""
    return {"task": str(task), "provider": {"kind": "local", "ckpt": str(ckpt)}, "seed": seed, "harness": harness,
            "backend": "namespace", "label": label, "out": str(out),
            "sampling": {"effort": effort, "temperature": temperature, "max_tokens": max_tokens}}


def fine_tune(init: Path, data: Path, out: Path, steps: int, batch_size: int, lr: float, threads, *,
              seq_len: int = 1024, val_percent: int = 0, include_failed: bool = False, log_interval: int = 50,
              log=print):
    """``k3 sft`` of ``init`` on ``data`` (a conversations file or folder) into ``out``: the one Trainer,
    packed rows, the demos' schedule (5 % warm-up, decay over the last half, no mid-run checkpoint).
    Returns the Trainer's result and the corpus counts."""
    from k3.rl.sft import SFTRows
    from k3.train.config import TrainConfig
    from k3.train.loop import Trainer
    tc = TrainConfig.build(None, {
        "init_from": str(init), "sft_data": str(data), "out": str(out), "steps": steps, "batch_size": batch_size,
        "curriculum": [[0, seq_len]], "lr": lr, "warmup_frac": 0.05, "decay_frac": 0.5, "eval_interval": 0,
        "val_percent": val_percent, "ckpt_interval": 0, "threads": threads, "log_interval": log_interval,
        "include_failed": include_failed})
    trainer = Trainer(tc, overwrite=True, read_rows=SFTRows())
    log("   " + trainer.corpus.summary())
    res = trainer.train()
    return res, trainer.corpus.counts()


def episode_stats(trajectory: str | os.PathLike) -> dict:
    """Per episode: assistant turns, the well-formed ones (finished by ``<|im_end|>`` after a closed
    thinking section, every tool call a known tool with JSON-object arguments), tool calls made."""
    from k3.rl.trajectory import read_trajectory

    p = Path(trajectory)
    if not p.is_file():
        return {"turns": 0, "well_formed": 0, "tool_calls": 0, "reasoning_chars": 0}
    recs = read_trajectory(p)
    bad_calls: dict[int, int] = {}
    for r in recs:
        if r["type"] == "tool" and r["result"].get("meta", {}).get("bad_call"):
            bad_calls[r["turn"]] = bad_calls.get(r["turn"], 0) + 1
    turns = [r for r in recs if r["type"] == "turn"]
    ok = sum(1 for t in turns if t["metadata"].get("finish_reason") in ("stop", "tool_calls")
             and not bad_calls.get(t["index"]))
    reasoning = sum(len(t.get("reasoning") or "") for t in turns)
    return {"turns": len(turns), "well_formed": ok, "tool_calls": sum(len(t["tool_calls"]) for t in turns),
            "reasoning_chars": reasoning}


def format_table(report: dict) -> str:
    lines = [f"{'model':5} {'family':6} {'domain':13} {'effort':6} {'pass':>9} {'well-formed turns':>18}"]
    for c in report["cells"]:
        lines.append(f"{c['model']:5} {c['family']:6} {c['domain']:13} {c['effort']:6} "
                     f"{c['passed']:>3}/{c['tasks']:<3} {100 * c['pass_rate']:3.0f}% "
                     f"{c['well_formed']:>5}/{c['turns']:<5} {100 * c['well_formed_rate']:4.0f}%")
    t = report["times"]
    lines.append("times: " + ", ".join(f"{k[:-2]} {v:.0f} s" for k, v in t.items()))
    return "\n".join(lines)


def ensure_base(base: Path, log=print) -> bool:
    """Pretrain the agent base into ``base`` (``k3 demo``'s code, ``AGENT_BASE_CONFIG``) unless it
    holds a checkpoint already; True when it was pretrained now."""
    if _has_checkpoint(base):
        return False
    log(f"== no checkpoint in {base}: pretraining it first (k3 demo's code, the agent base recipe)")
    from k3.cli.train import AGENT_BASE_CONFIG, AGENT_BASE_STEPS, demo_main
    if demo_main(["--out", str(base)], recipe=(AGENT_BASE_CONFIG, AGENT_BASE_STEPS)) != 0:
        raise RuntimeError("the demo's pretraining failed")
    return True


def _has_checkpoint(path: Path) -> bool:
    """A run with a checkpoint, a checkpoint folder or a model directory with its tokenizer."""
    from k3.errors import ConfigError
    from k3.train.config import init_model_dir
    if not path.is_dir():
        return False
    try:
        init_model_dir(str(path))
    except ConfigError:
        return False
    return True


def _append_results(report: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        for c in report["cells"]:
            f.write(json.dumps({"bench": "agent_demo", "config": f"{c['model']}/{c['family']}/{c['effort']}",
                                "metric": "pass_rate", "value": c["pass_rate"], "baseline": None, "ratio": None,
                                **{k: c[k] for k in ("tasks", "passed", "turns", "well_formed")},
                                "times": report["times"], "machine": report["machine"],
                                "date": report["date"]}) + "\n")


def agent_demo_main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="k3 agent-demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--base", default="runs/agent-base", help="pretrained run to start from (trained first if "
                                                               "missing, with the agent base recipe)")
    p.add_argument("--out", default="runs/agent-demo")
    p.add_argument("--arith-seeds", type=int, default=TRAIN_SEEDS["arith"])
    p.add_argument("--files-seeds", type=int, default=TRAIN_SEEDS["files"])
    p.add_argument("--code-seeds", type=int, default=TRAIN_SEEDS["code"])
    p.add_argument("--heldout", type=int, default=20, help="held-out tasks per family × effort")
    p.add_argument("--control", type=int, default=3, help="held-out tasks per family for the base model")
    p.add_argument("--steps", type=int, default=SFT_STEPS)
    p.add_argument("--batch-size", type=int, default=SFT_BATCH)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--lr", type=float, default=SFT_LR)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=400, help="tokens per assistant turn")
    p.add_argument("--threads", default="auto")
    p.add_argument("--harness-seeds", default=None, metavar="A:B",
                   help="synthesize the SFT episodes under randomized harnesses A..B-1 (one row per turn; "
                        "default: the canonical harness, one row per episode)")
    a = p.parse_args(argv)

    def run() -> int:
        from k3.errors import ConfigError
        for name in ("arith_seeds", "files_seeds", "code_seeds", "steps", "batch_size", "seq_len", "workers",
                     "max_tokens"):
            if getattr(a, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(a, name)}")
        for name in ("heldout", "control"):
            if getattr(a, name) < 0:
                raise ConfigError(f"--{name} must be >= 0, got {getattr(a, name)}")
        threads = a.threads if a.threads == "auto" else int(a.threads)
        from k3.rl.synth import parse_seeds
        harness = None if a.harness_seeds is None else parse_seeds(a.harness_seeds, "--harness-seeds")
        AgentDemo(Path(a.base), Path(a.out), {"arith": a.arith_seeds, "files": a.files_seeds, "code": a.code_seeds},
                  a.heldout, a.control, a.steps, a.batch_size, a.seq_len, a.lr, a.workers, a.max_tokens,
                  threads, harness_seeds=harness).run()
        return 0

    from k3.cliutil import guarded
    return guarded("agent-demo", run)
