"""The nine-teacher distillation demo (docs/DISTILL.md): 3 domains × 3 efforts, one student, two baselines.

0. **Base**: the agent base (``--base``; pretrained first when missing, as ``k3 agent-demo`` does).
1. **Data**: the agent demo's SFT conversations (``k3.rl.synth``: scripted solvers in the real
   harness and sandboxes, passing episodes only), one file per family × effort, on training seeds.
2. **Generalist**: the base fine-tuned on all nine files (``--general-steps``; the agent demo's SFT
   recipe by default). It is both the teachers' start and the student init: all three arms start from it.
3. **Teachers**: nine further fine-tunes of the generalist, each on one cell's file alone
   (``--teacher-steps`` at ``--teacher-lr``): a teacher per (domain, effort) tag (arith = general,
   files = general_agent, code = coding_agent).
4. **Arms at the same student compute** (the same steps, 9 episodes a step on the same task
   positions and efforts; the SFT arm's batch is sized so that its steps see each teacher sample once):
   - ``distill``: ``k3 distill`` from the nine teachers (exact reverse KL, groups of 1, 9 tasks a step);
   - ``sft``: off-policy distillation, ``k3 sft`` on the teachers' own samples (temperature 1, the
     same task positions and efforts, each by its tag's teacher, failed ones included: imitation, as
     the distill arm, which is not filtered by reward either);
   - ``rl``: ``k3 rl`` from the verifier alone (groups of 3, 3 tasks a step, harness randomization
     off as in the other arms).
   The task list repeats a 9-position pattern whose position p has effort p mod 3, so that every
   step of every arm covers all nine (family, effort) cells.
   Each arm has its own lr: ``--lr`` (distill), ``--teacher-lr`` (the SFT arm, as the teachers'
   fine-tunes from the generalist) and ``--rl-lr``.
5. **Evaluation**: held-out seeds of every cell, greedy, the canonical harness (the agent demo's
   ``evaluate_heldout``), for every teacher, the student init (the generalist) and the three arms.

``--families`` restricts the demo to those families' cells (their teachers, a pattern of those
families alone: ``k3.tasks.families.cell_pattern``, evaluation on their cells); ``--init`` takes an
existing checkpoint as the student init and the teachers' start in place of stage 2 (no base is
pretrained then).

Writes ``OUT/report.json`` (cells, targets, times, machine, date) and one JSON line per cell to
``benchmarks/results/distill_demo.jsonl``. ``--reuse`` keeps the stages whose outputs are there
(data files, checkpoints, teacher samples, evaluations); the report lists a stage whose outputs
were all reused under ``reused``, without a time of this run; ``earlier_times`` carries what the
report of the invocation that made them measured. ``python benchmarks/docs_tables.py
--save-distill OUT/report.json`` records it under docs/data and renders its table into docs/DISTILL.md.

    python benchmarks/distill_demo.py [--base runs/agent-base] [--out runs/distill-demo] [--steps 60] [--reuse]
        [--families arith --init runs/agent-demo/sft --heldout 60]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODELS = ("init", "distill", "sft", "rl")
CURVE_KEYS = ("step", "reward_mean", "pass_rate", "kl_teacher", "kl_by_tag", "pass_by_tag", "reasoning_by_tag",
              "groups_degenerate", "reasoning_tokens")


def episode_tokens(trajectory: Path) -> int:
    """Tokens of an episode's whole conversation: its last turn's prompt and sampled tokens."""
    from k3.rl.grpo import episode_sequences
    from k3.rl.trajectory import read_trajectory
    seqs = episode_sequences(read_trajectory(trajectory))
    return max((len(q["ids"]) for q in seqs), default=0)


def earlier_times(report: Path, reused: list[str]) -> dict[str, float]:
    """The times an earlier invocation's report (``report``, about to be replaced) measured for the
    stages this one reused: its own times, else the ones it carried from the invocation before it."""
    if not reused or not report.is_file():
        return {}
    old = json.loads(report.read_text())
    known = {**old.get("earlier_times", {}), **old.get("times", {})}
    return {f"{s}_s": known[f"{s}_s"] for s in reused if f"{s}_s" in known}


def targets(cells: list[dict], teachers: dict[str, str]) -> dict:
    """The issue's targets from the evaluated cells. ``teachers`` maps a teacher's model name to
    its own cell ``family/effort``. Within 10 %: the student's pass rate >= 0.9 × the teacher's on
    that teacher's cell (relative; the absolute gap is reported beside it)."""
    rate = {(c["model"], f"{c['family']}/{c['effort']}"): c["pass_rate"] for c in cells}
    cell_names = list(dict.fromkeys(f"{c['family']}/{c['effort']}" for c in cells))

    def mean(model):
        return statistics.fmean(rate[(model, k)] for k in cell_names)

    own = {t: {"cell": k, "teacher": rate[(t, k)], "student": rate[("distill", k)],
               "gap": rate[("distill", k)] - rate[(t, k)],
               "within_10pct": rate[("distill", k)] >= 0.9 * rate[(t, k)] - 1e-9} for t, k in teachers.items()}
    avg = {m: mean(m) for m in [*teachers, *MODELS]}
    reasoning = {}
    for e in ("low", "high", "max"):
        mine = [c for c in cells if c["model"] == "distill" and c["effort"] == e]
        reasoning[e] = statistics.fmean(c["reasoning_chars"] for c in mine)
    return {"own_cell": own, "all_within_10pct": all(v["within_10pct"] for v in own.values()),
            "mean_over_cells": avg, "above_every_teacher": all(avg["distill"] > avg[t] for t in teachers),
            "student_reasoning_chars": reasoning,
            "reasoning_ordered": reasoning["low"] < reasoning["high"] < reasoning["max"],
            "ahead_of_baselines": avg["distill"] > avg["sft"] and avg["distill"] > avg["rl"]}


def main() -> int:
    from k3.cli.agent_demo import SFT_BATCH, SFT_LR, SFT_STEPS, TRAIN_SEEDS
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", default="runs/agent-base", help="the agent base (pretrained first when missing)")
    p.add_argument("--out", default="runs/distill-demo")
    p.add_argument("--seeds", default=",".join(f"{f}:{n}" for f, n in TRAIN_SEEDS.items()),
                   help="SFT training seeds per family")
    p.add_argument("--families", default=None,
                   help="the families whose cells the demo covers (comma-separated; default all three)")
    p.add_argument("--init", default=None,
                   help="a checkpoint to take as the student init (the teachers' start) instead of fine-tuning "
                        "the generalist")
    p.add_argument("--general-steps", type=int, default=SFT_STEPS, help="SFT steps of the generalist (student init)")
    p.add_argument("--general-batch", type=int, default=SFT_BATCH)
    p.add_argument("--sft-lr", type=float, default=SFT_LR, help="lr of the generalist's SFT")
    p.add_argument("--teacher-steps", type=int, default=100, help="SFT steps of each teacher from the generalist")
    p.add_argument("--teacher-batch", type=int, default=4)
    p.add_argument("--teacher-lr", type=float, default=1e-3, help="lr of the teachers' SFT and of the SFT arm")
    p.add_argument("--steps", type=int, default=60, help="steps of each arm")
    p.add_argument("--lr", type=float, default=5e-4, help="lr of the distill arm")
    p.add_argument("--forward-weight", type=float, default=0.0,
                   help="the distill arm's k3 distill --forward-weight (0: the reverse KL alone)")
    p.add_argument("--rl-lr", type=float, default=3e-4, help="lr of the rl arm")
    p.add_argument("--max-tokens", type=int, default=400, help="tokens per assistant turn")
    p.add_argument("--heldout", type=int, default=20, help="held-out tasks per family × effort")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--threads", default="auto")
    p.add_argument("--reuse", action="store_true", help="keep the stages whose outputs are in OUT")
    p.add_argument("--results", default=str(ROOT / "benchmarks" / "results" / "distill_demo.jsonl"))
    a = p.parse_args()

    from k3.cli.agent_demo import _has_checkpoint, ensure_base, evaluate_heldout, fine_tune, local_job, machine
    from k3.cli.rl import distill_main, rl_main
    from k3.rl.rollout import run_jobs
    from k3.rl.synth import synthesize
    from k3.errors import ConfigError
    from k3.tasks.families import EFFORTS, cell_order, cell_pattern, cell_task_list, family_counts, get_family
    from k3.train.metrics import read_metrics

    base, out = Path(a.base), Path(a.out)
    try:
        seeds = family_counts(a.seeds, 1)
        pattern = cell_pattern(a.families.split(",") if a.families else seeds)
        if a.init is not None and not _has_checkpoint(Path(a.init)):
            raise ConfigError(f"--init {a.init}: no checkpoint there")
    except ConfigError as e:
        print(f"distill_demo: {e}", file=sys.stderr)
        return 2
    fams = list(dict.fromkeys(pattern))
    bad = [f"--{k.replace('_', '-')} must be >= {low}, got {getattr(a, k)}"
           for k, low in (("general_steps", 1), ("general_batch", 1), ("teacher_steps", 1), ("teacher_batch", 1),
                          ("steps", 1), ("max_tokens", 1), ("workers", 1), ("heldout", 0))
           if getattr(a, k) < low]
    bad += [f"--{k.replace('_', '-')} must be > 0, got {getattr(a, k)}"
            for k in ("sft_lr", "teacher_lr", "lr", "rl_lr") if not getattr(a, k) > 0]
    if not 0 <= a.forward_weight <= 1:
        bad.append(f"--forward-weight must be in [0, 1], got {a.forward_weight}")
    if bad:
        print(f"distill_demo: {bad[0]}", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    cells = [(f, e) for f in fams for e in EFFORTS]
    times: dict[str, float] = {}
    t0 = time.monotonic()
    if a.init is None and ensure_base(base):   # the base is only the generalist's start
        times["pretrain_s"] = round(time.monotonic() - t0, 1)

    def tag(f, e):
        return f"{get_family(f).domain}/{e}"

    reused: list[str] = []

    def stage(name):
        t = time.monotonic()
        print(f"== {name}", flush=True)

        def done(ran: bool = True):   # a stage whose outputs were all reused has no time of this run
            if ran:
                times[f"{name}_s"] = round(time.monotonic() - t, 1)
            else:
                reused.append(name)
        return done

    def sft(init, data, run, steps, batch, lr, include_failed=False):
        if a.reuse and _has_checkpoint(run):
            print(f"   {run}: reused", flush=True)
            return None
        return fine_tune(init, data, run, steps, batch, lr, a.threads, include_failed=include_failed,
                         log=lambda m: print(m, flush=True))[1]

    # 1. data
    done = stage("data")
    data = out / "data"
    todo = [(f, e) for f, e in cells if not (a.reuse and (data / f"{f}-{e}.jsonl").is_file())]
    for f, e in todo:
        rep = synthesize(f, range(seeds[f]), [e], data / f"{f}-{e}.jsonl", workers=a.workers, overwrite=True)
        print(f"   {f}/{e}: {rep.rows} conversations from {rep.episodes} episodes", flush=True)
    done(bool(todo))

    # 2. the generalist (the student init), 3. the teachers from it
    if a.init is None:
        done = stage("init")
        init = out / "student-init"
        done(sft(base, data, init, a.general_steps, a.general_batch, a.sft_lr) is not None)
    else:
        init = Path(a.init)
    done = stage("teachers")
    teachers = {}   # model name -> (family, effort, run)
    ran = []
    for f, e in cells:
        name = f"teacher-{f}-{e}"
        teachers[name] = (f, e, out / "teachers" / f"{f}-{e}")
        ran.append(sft(init, data / f"{f}-{e}.jsonl", teachers[name][2], a.teacher_steps, a.teacher_batch,
                       a.teacher_lr))
    toml = out / "teachers.toml"
    toml.write_text("".join(f'["{tag(f, e)}"]\ncheckpoint = "{run.resolve()}"\n\n' for f, e, run in teachers.values()))
    done(any(r is not None for r in ran))

    # the arms' tasks: training seeds, the pattern repeated once per step
    made = {f: [get_family(f).generate(i, out / "train-tasks", overwrite=True)
                for i in range(pattern.count(f) * a.steps)] for f in fams}
    tasks = cell_task_list(made, a.steps, pattern)
    efforts = [e for _, e in cell_order(pattern)] * a.steps
    common = ["--effort", "all", "--max-tokens", str(a.max_tokens), "--steps", str(a.steps),
              "--workers", str(a.workers), "--threads", str(a.threads), "--ckpt-interval", "0", "--no-rollouts",
              "--no-randomize", "--overwrite"]
    for _, t in tasks:
        common += ["--tasks", str(t)]

    def arm(name, main, argv):
        done = stage(name)
        run = out / name
        again = not (a.reuse and _has_checkpoint(run))
        if not again:
            print(f"   {run}: reused", flush=True)
        elif main(argv + ["--out", str(run)] + common) != 0:
            raise SystemExit(f"distill_demo: the {name} arm failed")
        done(again)
        return [r for r in read_metrics(run) if r["kind"] == "rl"]

    dist = arm("distill", distill_main, ["--student", str(init), "--teachers", str(toml), "--group", "1",
                                         "--tasks-per-step", "9", "--lr", str(a.lr),
                                         "--forward-weight", str(a.forward_weight)])
    rl = arm("rl", rl_main, ["--from", str(init), "--group", "3", "--tasks-per-step", "3", "--lr", str(a.rl_lr)])

    # the SFT arm: the teachers' samples on the same task positions and efforts
    done = stage("teacher_samples")
    samples = out / "teacher-samples"
    by_cell = {(f, e): run for f, e, run in teachers.values()}
    jobs = []
    for i, ((fam, t), e) in enumerate(zip(tasks, efforts)):
        dst = samples / f"{i:04d}-{t.name}.{e}.jsonl"
        if a.reuse and dst.is_file():
            continue
        jobs.append(local_job(t, by_cell[(fam, e)], dst, f"{fam}/{e}", e, 1.0, a.max_tokens, seed=i))
    if jobs:
        run_jobs(jobs, workers=a.workers)
    done(bool(jobs))
    done = stage("sft")
    batch = max(1, math.ceil(sum(map(episode_tokens, samples.glob("*.jsonl"))) / (a.steps * 1024)))
    counts = sft(init, samples, out / "sft", a.steps, batch, a.teacher_lr, include_failed=True)
    done(counts is not None)

    # 5. evaluation
    done = stage("eval")
    evaluated, fresh = [], 0
    models = {**{n: run for n, (_, _, run) in teachers.items()}, "init": init, **{m: out / m for m in MODELS[1:]}}
    for name, run in models.items():
        cache = out / "eval" / f"{name}.json"
        if a.reuse and cache.is_file():
            mine = json.loads(cache.read_text())
        else:
            mine = evaluate_heldout(run, out, EFFORTS, a.heldout, name, a.workers, a.max_tokens, families=fams)
            fresh += 1
            cache.parent.mkdir(parents=True, exist_ok=True)
            cache.write_text(json.dumps(mine) + "\n")
        print(f"   {name:20} " + " ".join(f"{c['family']}/{c['effort']} {c['passed']}/{c['tasks']}" for c in mine),
              flush=True)
        evaluated += mine
    done(fresh > 0)

    def tot(recs, key):
        return sum(r[key] for r in recs)

    report = {
        "cells": evaluated,
        "teachers": {n: {"family": f, "effort": e, "tag": tag(f, e)} for n, (f, e, _) in teachers.items()},
        "targets": targets(evaluated, {n: f"{f}/{e}" for n, (f, e, _) in teachers.items()}),
        "curves": {name: [{k: r.get(k) for k in CURVE_KEYS} for r in recs]
                   for name, recs in (("distill", dist), ("rl", rl))},
        "compute": {"distill": {"steps": len(dist), "sampled_tokens": tot(dist, "sampled_tokens"),
                                "trained_tokens": tot(dist, "trained_tokens")},
                    "rl": {"steps": len(rl), "sampled_tokens": tot(rl, "sampled_tokens"),
                           "trained_tokens": tot(rl, "trained_tokens")},
                    "sft": {"steps": a.steps, "batch_size": batch, "seq_len": 1024, **(counts or {})}},
        "options": {"base": str(base), "init": a.init, "families": fams, "seeds": seeds,
                    "general_steps": a.general_steps,
                    "general_batch": a.general_batch, "sft_lr": a.sft_lr, "teacher_steps": a.teacher_steps,
                    "teacher_batch": a.teacher_batch, "teacher_lr": a.teacher_lr, "steps": a.steps, "lr": a.lr,
                    "rl_lr": a.rl_lr, "max_tokens": a.max_tokens, "heldout": a.heldout,
                    "estimator": "exact", "forward_weight": a.forward_weight, "temperature": 1.0},
        "times": times, "reused": reused, "earlier_times": earlier_times(out / "report.json", reused),
        "machine": machine(), "date": time.strftime("%Y-%m-%d"),
    }
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    res = Path(a.results)
    res.parent.mkdir(parents=True, exist_ok=True)
    with open(res, "a") as fh:
        for c in evaluated:
            fh.write(json.dumps({"bench": "distill_demo", "config": f"{c['model']}/{c['family']}/{c['effort']}",
                                 "metric": "pass_rate", "value": c["pass_rate"], "baseline": None, "ratio": None,
                                 "tasks": c["tasks"], "passed": c["passed"], "machine": report["machine"],
                                 "date": report["date"]}) + "\n")
    tg = report["targets"]
    print(f"report: {out / 'report.json'}; mean pass over the {len(cells)} cells: "
          + ", ".join(f"{k} {v:.2f}" for k, v in tg["mean_over_cells"].items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
