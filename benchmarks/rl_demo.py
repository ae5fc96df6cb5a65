"""The RL demo (docs/RL.md): ``k3 rl`` on the agent demo's SFT checkpoint, within a wall-clock budget.

1. **Before**: held-out pass rates of the SFT checkpoint per family × effort (the canonical
   harness, greedy: the agent demo's evaluation), and at ``--spread-effort`` under each of
   ``--harness-seeds`` harness randomization seeds (the spread across "exam rooms").
2. **RL**: ``k3 rl`` from that checkpoint on the families' training seeds (held-out seeds are
   refused by ``k3 rl`` itself), generated into ``OUT/train-tasks`` and passed in the cell pattern
   of ``k3.tasks.families.cell_task_list`` (a step takes consecutive tasks and the efforts cycle
   per group, so each nine groups meet all nine family × effort cells; plain interleaving would
   pair each family with one effort), harness randomization on with ``--canonical`` of the groups
   on the canonical harness (every second one at 0.5), for at most ``--minutes`` of wall time: when
   a step ends past the budget, the run's last step is that one. The "before" evaluation is kept
   in ``OUT/before.json`` and reused by a rerun with the same checkpoint and evaluation options.
3. **After**: the same evaluations of the RL checkpoint.

``--only FAMILY:N`` spends the whole budget on one family: RL on its first N training seeds in
order (``--efforts`` cycled per group, default all three), and both evaluations of that family
alone (so ``--heldout`` can be larger at the same cost). The family with room to improve is the
question it answers: does RL move it when nothing else takes the budget.

Writes ``OUT/report.json`` (cells before and after, the reward curve, sampling and training
tokens/s, the RL options, machine and date) and one JSON line per cell to
``benchmarks/results/rl_demo.jsonl``. ``python benchmarks/docs_tables.py --save-rl OUT/report.json``
records the report under docs/data and renders its table into docs/RL.md.

    python benchmarks/rl_demo.py [--sft runs/agent-demo/sft] [--out runs/rl-demo] [--minutes 20]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def spread(cells: list[dict]) -> dict:
    """Per family: pass rates across harness seeds, their mean and population std."""
    out: dict[str, dict] = {}
    for c in cells:
        out.setdefault(c["family"], {"rates": []})["rates"].append(c["pass_rate"])
    for v in out.values():
        v["mean"] = statistics.fmean(v["rates"])
        v["std"] = statistics.pstdev(v["rates"])
        v["range"] = max(v["rates"]) - min(v["rates"])
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sft", default="runs/agent-demo/sft", help="the agent demo's SFT run (make agent-demo)")
    p.add_argument("--out", default="runs/rl-demo")
    p.add_argument("--minutes", type=float, default=15.0, help="wall-clock budget of the RL run (<= 20)")
    p.add_argument("--max-steps", type=int, default=400)
    p.add_argument("--seeds", default="arith:30,files:30,code:30",
                   help="training seeds per family, FAMILY:N,... (N // 3 blocks of the cell pattern)")
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--tasks-per-step", type=int, default=2)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--canonical", type=float, default=0.5,
                   help="the fraction of groups sampled on the canonical harness (k3 rl --canonical)")
    p.add_argument("--max-tokens", type=int, default=400, help="tokens per assistant turn (as the evaluation)")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--heldout", type=int, default=20, help="held-out tasks per family × effort")
    p.add_argument("--harness-seeds", type=int, default=5)
    p.add_argument("--spread-effort", default="max")
    p.add_argument("--threads", default="1")
    p.add_argument("--results", default=str(ROOT / "benchmarks" / "results" / "rl_demo.jsonl"))
    p.add_argument("--only", metavar="FAMILY:N", help="RL on this family's first N training seeds alone, "
                                                        "and evaluate it alone")
    p.add_argument("--efforts", default="all", help="the efforts RL cycles per group: all, or a comma list")
    a = p.parse_args()

    from k3.cli.agent_demo import evaluate_heldout, machine
    from k3.cli.rl import rl_main
    from k3.errors import ConfigError
    from k3.tasks.families import EFFORTS, FAMILIES, cell_task_list, family_counts, get_family
    from k3.train.metrics import read_metrics

    try:   # before anything runs: the "before" evaluation alone takes minutes
        if a.only is None:
            counts, families = family_counts(a.seeds, 3), list(FAMILIES)
        else:
            fam, _, n = a.only.partition(":")
            if fam not in FAMILIES or not n.isdigit() or int(n) < 1:
                raise ConfigError(f"--only must be FAMILY:N with a family of {', '.join(FAMILIES)} and N >= 1, "
                                  f"got {a.only}")
            counts, families = {fam: int(n)}, [fam]
        efforts = list(EFFORTS) if a.efforts == "all" else a.efforts.split(",")
        if not efforts or any(e not in EFFORTS for e in efforts) or len(set(efforts)) != len(efforts):
            raise ConfigError(f"--efforts must be all or a comma list of distinct {', '.join(EFFORTS)}, "
                              f"got {a.efforts}")
    except ConfigError as e:
        print(f"rl_demo: {e}", file=sys.stderr)
        return 2
    sft, out = Path(a.sft), Path(a.out)
    if not (sft / "checkpoint").is_dir():
        print(f"rl_demo: {sft} holds no checkpoint (run make agent-demo first)", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    times: dict[str, float] = {}

    def evaluate(ckpt: Path, model: str) -> tuple[list[dict], list[dict]]:
        t0 = time.monotonic()
        cells = evaluate_heldout(ckpt, out, EFFORTS, a.heldout, model, a.workers, a.max_tokens, families=families)
        seeds = []
        for h in range(1, a.harness_seeds + 1):
            seeds += evaluate_heldout(ckpt, out, (a.spread_effort,), a.heldout, model, a.workers, a.max_tokens,
                                      harness=h, families=families)
        times[f"eval_{model}_s"] = time.monotonic() - t0
        for c in cells:
            print(f"  {model:6} {c['family']:6} {c['effort']:5} {c['passed']:>3}/{c['tasks']}", flush=True)
        for fam, v in spread(seeds).items():
            print(f"  {model:6} {fam:6} over {a.harness_seeds} harness seeds: {v['rates']} "
                  f"(std {v['std']:.3f})", flush=True)
        return cells, seeds

    cache = out / "before.json"
    key = {"sft": str(sft.resolve()), "heldout": a.heldout, "harness_seeds": a.harness_seeds,
           "spread_effort": a.spread_effort, "max_tokens": a.max_tokens,
           **({} if a.only is None else {"families": families})}
    saved = json.loads(cache.read_text()) if cache.is_file() else None
    if saved is not None and saved["key"] == key:
        print(f"== before: {sft} (from {cache})", flush=True)
        before, before_seeds, times["eval_sft_s"] = saved["cells"], saved["harness_cells"], saved["eval_s"]
    else:
        print(f"== before: {sft}", flush=True)
        before, before_seeds = evaluate(sft, "sft")
        cache.write_text(json.dumps({"key": key, "cells": before, "harness_cells": before_seeds,
                                     "eval_s": times["eval_sft_s"]}) + "\n")

    print(f"== k3 rl for at most {a.minutes:g} minutes", flush=True)
    run = out / "rl"
    made = {f: [get_family(f).generate(i, out / "train-tasks", overwrite=True) for i in range(n)]
            for f, n in counts.items()}
    if a.only is None:
        blocks = min(counts.values()) // 3
        tasks = [str(t) for _, t in cell_task_list(made, blocks)]
        names = [f"{f}:0:{3 * blocks}" for f in counts]
    else:
        tasks = [str(t) for t in made[families[0]]]
        names = [f"{families[0]}:0:{counts[families[0]]}"]
    argv = ["--from", str(sft), "--out", str(run), "--overwrite", "--group", str(a.group),
            "--tasks-per-step", str(a.tasks_per_step), *(x for e in efforts for x in ("--effort", e)),
            "--max-tokens", str(a.max_tokens),
            "--lr", str(a.lr), "--canonical", str(a.canonical), "--steps", str(a.max_steps),
            "--workers", str(a.workers),
            "--threads", a.threads, "--ckpt-interval", "10", "--no-rollouts"]
    for t in tasks:
        argv += ["--tasks", t]
    budget = a.minutes * 60
    t0 = time.monotonic()

    def hook(trainer):
        def stop_when_spent(tr, rec):
            if time.monotonic() - t0 > budget and tr.tc.steps > tr.step:
                tr.tc.steps = tr.step   # this step is the run's last: it saves and ends normally
        trainer.on_step_end.append(stop_when_spent)

    rc = rl_main(argv, trainer_hook=hook)
    times["rl_s"] = time.monotonic() - t0
    if rc != 0:
        print(f"rl_demo: k3 rl exited {rc}", file=sys.stderr)
        return 1
    recs = read_metrics(run)
    rl = [r for r in recs if r["kind"] == "rl"]
    hacks = [r for r in recs if r["kind"] == "hacks"]

    print(f"== after: {run}", flush=True)
    after, after_seeds = evaluate(run, "rl")

    def tot(key):
        return sum(r[key] for r in rl)

    report = {
        "cells": before + after, "harness_cells": before_seeds + after_seeds,
        "spread": {"sft": spread(before_seeds), "rl": spread(after_seeds)},
        "curve": [{k: r.get(k) for k in ("step", "reward_mean", "pass_rate", "pass_rate_canonical",
                                         "pass_rate_randomized", "reward_by_family", "groups_degenerate",
                                         "lost", "verifier_failed", "entropy", "reasoning_tokens", "tool_calls")}
                  for r in rl],
        "speed": {"sampled_tokens": tot("sampled_tokens"), "sample_s": tot("sample_s"),
                  "sampled_tokens_per_s": tot("sampled_tokens") / max(tot("sample_s"), 1e-9),
                  "trained_tokens": tot("trained_tokens"), "train_s": tot("train_s"),
                  "trained_tokens_per_s": tot("trained_tokens") / max(tot("train_s"), 1e-9),
                  "sequences": tot("sequences"), "sequences_zero_advantage": tot("sequences_zero_advantage"),
                  "steps_updated": sum("no_update" not in r for r in recs if r["kind"] == "train")},
        "hacks": hacks[-1] if hacks else None,
        "rl": {"steps": len(rl), "tasks": names, "order": "cell pattern" if a.only is None else "seed order",
               "group": a.group, "tasks_per_step": a.tasks_per_step,
               "lr": a.lr, "max_tokens": a.max_tokens, "workers": a.workers, "minutes": a.minutes,
               "effort": "all" if efforts == list(EFFORTS) else ", ".join(efforts), "temperature": 1.0,
               "randomize": True, "canonical": a.canonical},
        "eval": {"heldout": a.heldout, "harness_seeds": a.harness_seeds, "spread_effort": a.spread_effort,
                 "temperature": 0.0},
        "times": {k: round(v, 1) for k, v in times.items()},
        "machine": machine(), "date": time.strftime("%Y-%m-%d"),
    }
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    res = Path(a.results)
    res.parent.mkdir(parents=True, exist_ok=True)
    with open(res, "a") as f:
        for c in before + after:
            f.write(json.dumps({"bench": "rl_demo", "config": f"{c['model']}/{c['family']}/{c['effort']}",
                                "metric": "pass_rate", "value": c["pass_rate"], "baseline": None, "ratio": None,
                                "tasks": c["tasks"], "passed": c["passed"], "machine": report["machine"],
                                "date": report["date"]}) + "\n")
    print(f"report: {out / 'report.json'}  (rl {len(rl)} steps in {times['rl_s']:.0f} s; sampling "
          f"{report['speed']['sampled_tokens_per_s']:.0f} tok/s, training {report['speed']['trained_tokens_per_s']:.0f} tok/s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
