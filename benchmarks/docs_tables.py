"""Write the docs' generated tables from committed benchmark data (never typed in by hand).

Each table lives between ``<!-- NAME:begin -->`` and ``<!-- NAME:end -->`` in a docs file and is
rendered from a JSON record under ``docs/data/`` that carries its machine and date:

- ``agent_demo`` (docs/POSTTRAINING.md) from ``docs/data/agent_demo.json``, the report of one
  ``k3 agent-demo`` run (``runs/agent-demo/report.json`` copied there by ``--save``);
- ``rl_demo`` (docs/RL.md) from ``docs/data/rl_demo.json``, the report of one
  ``benchmarks/rl_demo.py`` run (``runs/rl-demo/report.json`` copied there by ``--save-rl``), and
  ``rl_demo_low_lr`` from ``docs/data/rl_demo_low_lr.json`` (the same demo at a lower ``--lr``,
  ``--save-rl-low-lr``) and ``rl_demo_arith`` from ``docs/data/rl_demo_arith.json`` (its budget on
  arith alone, ``--only arith:N``; ``--save-rl-arith``);
- ``distill_demo`` (docs/DISTILL.md) from ``docs/data/distill_demo.json``, the report of one
  ``benchmarks/distill_demo.py`` run (``runs/distill-demo/report.json`` copied there by ``--save-distill``),
  and ``distill_demo_steps120`` from ``docs/data/distill_demo_steps120.json`` (a ``--steps 120`` run,
  ``--save-distill-120``), and ``distill_demo_arith`` from ``docs/data/distill_demo_arith.json`` (the
  demo on arith's three cells alone from the agent demo's SFT checkpoint, ``--families arith --init``;
  ``--save-distill-arith``);
- ``eval_harness`` (docs/EVAL.md) from ``docs/data/eval_harness.jsonl``, the rows of one
  ``k3 eval harness`` run (``RUN/rows.jsonl`` copied there by ``--save-eval RUN``), and
  ``eval_harness_randomized`` from ``docs/data/eval_harness_randomized.jsonl`` (``--save-eval-randomized``);
- ``hybrid_retrieval`` (docs/EVAL.md) from ``docs/data/hybrid_retrieval.json``, the report of one
  ``benchmarks/hybrid_retrieval.py`` run (``runs/hybrid/report.json`` and its plot copied there
  by ``--save-hybrid``);
- the ``sustain`` table of docs/EVAL.md from ``docs/data/sustain.json``, a ``benchmarks/sustain.py``
  run (``runs/sustain/report.json`` and its plot copied there by ``--save-sustain``);
- ``vision_demo`` (docs/VISION.md) from ``docs/data/vision_demo.json``, the report of one
  ``k3 vision-demo`` run (``runs/vision-demo/report.json`` copied there by ``--save-vision``);
- ``speed_infer`` (docs/INFERENCE.md, README.md) and ``speed_train`` (README.md) from
  ``docs/data/speed.jsonl``: the last run of ``benchmarks/infer.py`` and of ``benchmarks/train.py
  --what mfu`` in the JSON-line files given to ``--save-speed`` (each row stamped with its machine,
  date and commit by ``benchmarks/_timing.py``);
- ``micro`` (README.md, "Measured") from ``docs/data/micro.jsonl``: the last run in each of the
  JSON-line files given to ``--save-micro`` (``benchmarks/results/{kda,model,moe,checkpoint,mx}.jsonl``),
  one table row per figure, each naming the machine, date and commit of its rows;
- ``demo`` (README.md, "What `make demo` does") from ``docs/data/demo.json``, the report of one
  ``k3 demo`` run (``runs/demo/report.json`` copied there by ``--save-demo``);
- ``ablations`` (README.md) from ``docs/data/ablations.jsonl``: the last run of
  ``benchmarks/ablations.py`` in the file given to ``--save-ablations``.

A row or report without its machine and date is refused (``Unstamped``): figures that do not say
where and when they were measured do not go into the docs. ``benchmarks/refresh_docs.sh`` reruns
the benchmarks and the demo and calls this with every ``--save-*``. ``--root DIR`` reads and writes
``DIR/docs/data``, ``DIR/README.md`` and ``DIR/docs/*.md`` instead of the repository's (a dry run on
a copy, e.g. of a short pipeline check whose figures must not reach the docs).

    python benchmarks/docs_tables.py [--save runs/agent-demo/report.json] [--save-rl runs/rl-demo/report.json]
                                     [--save-rl-low-lr runs/rl-demo-lr1e-4/report.json]
                                     [--save-rl-arith runs/rl-demo-arith/report.json]
                                     [--save-distill runs/distill-demo/report.json]
                                     [--save-distill-arith runs/distill-arith/report.json]
                                     [--save-hybrid runs/hybrid/report.json] [--save-eval RUN]
                                     [--save-sustain runs/sustain/report.json] [--save-eval-randomized RUN]
                                     [--save-vision runs/vision-demo/report.json]
                                     [--save-speed benchmarks/results/infer.jsonl benchmarks/results/train.jsonl]
                                     [--save-micro benchmarks/results/{kda,model,moe,checkpoint,mx}.jsonl]
                                     [--save-demo runs/demo/report.json]
                                     [--save-ablations benchmarks/results/ablations.jsonl] [--root DIR]
"""

from __future__ import annotations

import argparse
import functools
import json
import re
import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "docs" / "data" / "agent_demo.json"
DOC = ROOT / "docs" / "POSTTRAINING.md"
RL_DATA = ROOT / "docs" / "data" / "rl_demo.json"
RL_LOW_LR_DATA = ROOT / "docs" / "data" / "rl_demo_low_lr.json"   # the same demo at a lower lr
RL_ARITH_DATA = ROOT / "docs" / "data" / "rl_demo_arith.json"     # its budget on arith alone
RL_DOC = ROOT / "docs" / "RL.md"
DISTILL_DATA = ROOT / "docs" / "data" / "distill_demo.json"
DISTILL_DOC = ROOT / "docs" / "DISTILL.md"
DISTILL_LONG_DATA = ROOT / "docs" / "data" / "distill_demo_steps120.json"   # the same demo, 120 steps an arm
DISTILL_ARITH_DATA = ROOT / "docs" / "data" / "distill_demo_arith.json"   # the demo on arith's cells alone
HYBRID_DATA = ROOT / "docs" / "data" / "hybrid_retrieval.json"
SUSTAIN_DATA = ROOT / "docs" / "data" / "sustain.json"
EVAL_DOC = ROOT / "docs" / "EVAL.md"
EVAL_ROWS = ROOT / "docs" / "data" / "eval_harness.jsonl"
EVAL_ROWS_RANDOMIZED = ROOT / "docs" / "data" / "eval_harness_randomized.jsonl"
SPEED = ROOT / "docs" / "data" / "speed.jsonl"
VISION_DATA = ROOT / "docs" / "data" / "vision_demo.json"
VISION_DOC = ROOT / "docs" / "VISION.md"
INFER_DOC = ROOT / "docs" / "INFERENCE.md"
README = ROOT / "README.md"
MICRO = ROOT / "docs" / "data" / "micro.jsonl"
DEMO_DATA = ROOT / "docs" / "data" / "demo.json"
ABLATIONS = ROOT / "docs" / "data" / "ablations.jsonl"
SCALING_DATA = ROOT / "docs" / "data" / "scaling.json"
SCALING_DOC = ROOT / "docs" / "SCALING.md"
MX_LABELS = {"fp4_e2m1": "MXFP4", "fp8_e4m3": "MXFP8"}   # k3.ops.mx.MX_FORMATS keys -> OCP names
ABLATION_LABELS = {   # benchmarks/ablations.py group / variant -> the table's words
    "optimizer": "optimizer", "per_head": "Per-Head Muon", "muon": "full-matrix Muon", "adamw": "AdamW",
    "residual": "residual", "attn_res": "Block AttnRes", "standard": "standard residual",
    "activation": "activation", "situ": "SiTU", "swiglu": "SwiGLU",
    "balance": "router balance", "quantile": "Quantile Balancing", "sign": "DeepSeek-V3 sign update (rate 1e-3)",
}
INFER_ROWS = {   # benchmarks/infer.py metric -> the row's label
    "decode_step_b1_prepared": "decode step b1, prepared weights vs the modules (steps/s)",
    "ops_per_step_b1": "ops per step b1 (profiler events)",
    "decode_step_b16_prepared": "decode step b16, prepared weights vs the modules (steps/s)",
    "ops_per_step_b16": "ops per step b16 (profiler events)",
    "decode_tps_b1_vs_recompute": "decode b1 vs a full forward each step (tok/s)",
    "decode_tps_b16_vs_b1": "decode b16 aggregate vs b1 (tok/s)",
    "decode_tps_b1_vs_model_step": "decode b1 vs the engine over the modules (tok/s)",
    "roofline_b1": "roofline b1: active weight bytes per token at the measured read bandwidth",
    "decode_tps_b1_kimi_linear": "vs transformers `KimiLinearForCausalLM.generate` (Kimi-Linear mode)",
    "ttft_90pct_prefix_vs_cold": "TTFT, 90% shared prefix vs cold (ms)",
}


def agent_demo_table(report: dict) -> str:
    s, t = report["sft"], report["times"]
    head = ("| model | family (domain) | effort | held-out pass | well-formed turns |\n"
            "|---|---|---|---|---|")
    rows = [f"| {c['model']} | {c['family']} ({c['domain']}) | {c['effort']} | "
            f"{c['passed']}/{c['tasks']} ({100 * c['pass_rate']:.0f} %) | "
            f"{c['well_formed']}/{c['turns']} ({100 * c['well_formed_rate']:.0f} %) |" for c in report["cells"]]
    sft = [c for c in report["cells"] if c["model"] == "sft"]
    turns = sum(c["turns"] for c in sft)
    wf = sum(c["well_formed"] for c in sft) / max(turns, 1)
    times = ", ".join(f"{k.removesuffix('_s')} {v:.0f} s" for k, v in t.items())
    return "\n".join([
        f"Measured {report['date']} on {report['machine']} (`docs/data/agent_demo.json`).",
        f"SFT: {s['steps']} steps of {s['batch_size']} × {s['seq_len']} tokens, lr {s['lr']}, on "
        f"{s['train_conversations']:,} conversations ({s['trained_tokens']:,} trained tokens per epoch); "
        f"well-formed turns over all SFT cells: {100 * wf:.1f} %. Times: {times}.",
        "", head, *rows])


def vision_demo_table(report: dict) -> str:
    acc, s = report["accuracy"], report["sft"]["vision"]
    rows = []
    for k in [*report["kinds"], "all"]:
        v, c = acc["vision"][k], acc["control"][k]
        rows.append(f"| {k} | {v['correct']}/{v['n']} ({100 * v['accuracy']:.0f} %) | "
                    f"{c['correct']}/{c['n']} ({100 * c['accuracy']:.0f} %) |")
    return "\n".join([
        f"Measured {report['date']} on {report['machine']} (`docs/data/vision_demo.json`, which also holds "
        "the run's wall times).",
        f"Both models: {s['steps']} SFT steps of {s['batch_size']} × {s['seq_len']} tokens, lr {s['lr']}, from "
        f"one tiny base, on {s['train_conversations']:,} conversations ({report['train_seeds']} seeds per kind); "
        f"the vision model with a new `{report['tower']}` tower. Held out: {report['heldout_per_kind']} items per "
        "kind, greedy, exact match.",
        "", "| kind | vision | text-only control |", "|---|---|---|", *rows])


def rl_demo_table(report: dict, source: str = "docs/data/rl_demo.json") -> str:
    """Held-out pass rates before (SFT) and after RL per family × effort, the spread over harness
    seeds, the reward curve in brief, speeds and times (``source``: the report's file)."""
    cells = {(c["model"], c["family"], c["effort"]): c for c in report["cells"]}
    fams = list(dict.fromkeys(c["family"] for c in report["cells"]))
    efforts = list(dict.fromkeys(c["effort"] for c in report["cells"]))
    rl, ev, sp, t = report["rl"], report["eval"], report["speed"], report["times"]
    rows = ["| family | effort | SFT (before) | RL (after) | after ÷ before |", "|---|---|---|---|---|"]
    for f in fams:
        for e in efforts:
            b, a = cells[("sft", f, e)], cells[("rl", f, e)]
            ratio = f"{a['pass_rate'] / b['pass_rate']:.2f}×" if b["pass_rate"] else "–"
            rows.append(f"| {f} | {e} | {b['passed']}/{b['tasks']} ({100 * b['pass_rate']:.0f} %) | "
                        f"{a['passed']}/{a['tasks']} ({100 * a['pass_rate']:.0f} %) | {ratio} |")
        b, a = ({k: sum(cells[(m, f, e)][k] for e in efforts) for k in ("passed", "tasks")} for m in ("sft", "rl"))
        ratio = f"{a['passed'] / b['passed']:.2f}×" if b["passed"] else "–"
        rows.append(f"| **{f}** | **all** | **{b['passed']}/{b['tasks']} ({100 * b['passed'] / b['tasks']:.0f} %)** | "
                    f"**{a['passed']}/{a['tasks']} ({100 * a['passed'] / a['tasks']:.0f} %)** | **{ratio}** |")
    spread = ["| family | SFT: pass rate per harness seed (std) | RL: pass rate per harness seed (std) |",
              "|---|---|---|"]
    for f in fams:
        b, a = report["spread"]["sft"][f], report["spread"]["rl"][f]
        spread.append(f"| {f} | {' '.join(f'{x:.2f}' for x in b['rates'])} ({b['std']:.3f}) | "
                      f"{' '.join(f'{x:.2f}' for x in a['rates'])} ({a['std']:.3f}) |")
    curve = report["curve"]
    k = max(1, len(curve) // 10)
    pts = ", ".join(f"{c['step']}: {c['reward_mean']:.2f}" for c in curve[::k] if c["reward_mean"] is not None)
    times = ", ".join(f"{key.removesuffix('_s')} {v:.0f} s" for key, v in t.items())
    return "\n".join([
        f"Measured {report['date']} on {report['machine']} (`{source}`).",
        f"RL: {rl['steps']} steps in {t['rl_s'] / 60:.1f} min (budget {rl['minutes']:g} min), groups of "
        f"{rl['group']}, {rl['tasks_per_step']} tasks per step, lr {rl['lr']}, effort {rl['effort']}, "
        f"temperature {rl['temperature']}, harness randomization on"
        f"{_canonical(rl)}, {rl['workers']} rollout workers; tasks "
        f"{', '.join(rl['tasks'])}. Evaluation: {ev['heldout']} held-out tasks per cell, greedy, canonical "
        f"harness; the spread at effort {ev['spread_effort']} over {ev['harness_seeds']} harness seeds.",
        f"Sampling {sp['sampled_tokens_per_s']:.0f} tokens/s ({sp['sampled_tokens']:,} tokens), training "
        f"{sp['trained_tokens_per_s']:.0f} tokens/s ({sp['trained_tokens']:,.0f} tokens){_left_out(sp)}. "
        f"Times: {times}.",
        f"Mean reward by step: {pts}.", "", *rows, "", *spread])


def rl_demo_low_lr_table(report: dict) -> str:
    """``rl_demo_table`` of the run at a lower lr."""
    return rl_demo_table(report, "docs/data/rl_demo_low_lr.json")


def rl_demo_arith_table(report: dict) -> str:
    """``rl_demo_table`` of the run on arith alone (``rl_demo.py --only arith:N``)."""
    return rl_demo_table(report, "docs/data/rl_demo_arith.json")


def distill_demo_long_table(report: dict) -> str:
    """``distill_demo_table`` of the 120-step run."""
    return distill_demo_table(report, "docs/data/distill_demo_steps120.json")


def distill_demo_arith_table(report: dict) -> str:
    """``distill_demo_table`` of the run on arith's cells alone."""
    return distill_demo_table(report, "docs/data/distill_demo_arith.json")


def _left_out(sp: dict) -> str:
    """The RL demo's updated steps and the sequences of advantage 0 it left out of the update
    (reports before that rule have neither)."""
    if "steps_updated" not in sp:
        return ""
    return (f"; {sp['steps_updated']} steps updated the weights, {sp['sequences']:,} sequences trained and "
            f"{sp['sequences_zero_advantage']:,} of advantage 0 left out")


def _canonical(rl: dict) -> str:
    """How many of an RL demo's groups sampled on the canonical harness (none before ``canonical``)."""
    c = rl.get("canonical", 0)
    return f" ({c:g} of the groups on the canonical harness)" if c else ""


def distill_demo_table(report: dict, source: str = "docs/data/distill_demo.json") -> str:
    """Held-out pass rate of every teacher, the student init, the distilled student and the two
    baselines on each (family, effort) cell, each teacher's own cell in bold; the issue's targets,
    the student's reasoning length per effort, the arms' compute and the times (``source``: the
    report's file, named in the table's first line)."""
    rate = {(c["model"], f"{c['family']}/{c['effort']}"): c for c in report["cells"]}
    names = list(dict.fromkeys(f"{c['family']}/{c['effort']}" for c in report["cells"]))
    tg, o, cp = report["targets"], report["options"], report["compute"]
    own = {t["family"] + "/" + t["effort"]: n for n, t in report["teachers"].items()}
    label = {"init": "student init", "distill": "**student (on-policy distillation)**",
             "sft": "SFT on the teachers' samples", "rl": "RL from the verifier"}
    rows = ["| model | " + " | ".join(names) + " | mean |", "|---|" + "---|" * (len(names) + 1)]
    for m in [*report["teachers"], *label]:
        cells = []
        for k in names:
            c = rate[(m, k)]
            v = f"{100 * c['pass_rate']:.0f}"
            cells.append(f"**{v}**" if own.get(k) == m else v)
        name = f"teacher {report['teachers'][m]['tag']}" if m in report["teachers"] else label[m]
        rows.append(f"| {name} | " + " | ".join(cells) + f" | {100 * tg['mean_over_cells'][m]:.1f} |")
    misses = [f"{v['cell']} ({100 * v['student']:.0f} vs {100 * v['teacher']:.0f})"
              for v in tg["own_cell"].values() if not v["within_10pct"]]
    yes = {True: "met", False: "not met"}
    r = tg["student_reasoning_chars"]
    times = ", ".join(f"{key.removesuffix('_s')} {v:.0f} s" for key, v in report["times"].items())
    return "\n".join([
        f"Measured {report['date']} on {report['machine']} (`{source}`). "
        f"Held-out pass rate (%), {o['heldout']} tasks per cell, greedy, canonical harness.",
        (f"Student init: `{o['init']}`" if o.get("init") else
           f"Student init: the generalist, {o['general_steps']} SFT steps of {o['general_batch']} × 1024 tokens on "
           f"all {_count(len(names))} cells at lr {o['sft_lr']}")
        + f"; teachers: it, fine-tuned {o['teacher_steps']} steps of "
        f"{o['teacher_batch']} × 1024 on their own cell at lr {o['teacher_lr']}. Arms from the init, "
        f"{o['steps']} steps each: distill at lr {o['lr']}, {cp['distill']['trained_tokens']:,.0f} trained tokens "
        f"({_distill_loss(o)}, 9 episodes a step); RL at lr {o['rl_lr']}, {cp['rl']['trained_tokens']:,.0f} "
        f"(groups of 3 × 3 tasks); SFT at lr {o['teacher_lr']}, {cp['sft']['steps']} steps of "
        f"{cp['sft']['batch_size']} × 1024 on "
        + (f"{cp['sft']['train_conversations']} teacher samples ({cp['sft']['trained_tokens']:,} trained tokens an "
           "epoch)" if "train_conversations" in cp["sft"] else "the teacher samples (a reused run: not counted)")
        + f". Times: {times}" + _earlier(report),
        "", *rows, "",
        f"- Student within 10 % (relative) of each teacher on its own cell: {yes[tg['all_within_10pct']]}"
        + (f"; missed on {', '.join(misses)}." if misses else "."),
        f"- Student above every single teacher on the mean over the {_count(len(names))} cells: "
        f"{yes[tg['above_every_teacher']]}.",
        f"- Student's reasoning per episode (characters): low {r['low']:.0f}, high {r['high']:.0f}, "
        f"max {r['max']:.0f}; ordered low < high < max: {yes[tg['reasoning_ordered']]}.",
        f"- Student ahead of both baselines on the mean: {yes[tg['ahead_of_baselines']]}."])


def _distill_loss(options: dict) -> str:
    w = options.get("forward_weight", 0.0)
    return f"exact KL, {1 - w:g} × reverse + {w:g} × forward" if w else "exact reverse KL"


def _count(n: int) -> str:
    return ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")[n] if n < 10 else str(n)


def _earlier(report: dict) -> str:
    """The sentence end naming the stages a run reused and the times their own invocation measured."""
    if not report.get("reused"):
        return "."
    had = report.get("earlier_times", {})
    when = ", ".join(f"{k.removesuffix('_s')} {v:.0f} s" for k, v in had.items())
    return (f"; reused from an earlier invocation: {', '.join(report['reused'])}"
            + (f" (which took {when})." if when else "."))


def hybrid_table(report: dict) -> str:
    """Multi-key accuracy and decode cache per layout and context length, with the training run."""
    lays = report["layouts"]
    ts = sorted({int(t) for r in lays.values() for t in r["accuracy"]})
    head = "| layout | parameters | final loss on the answers | " + " | ".join(f"T={t}" for t in ts) + " |"
    rows = [head, "|---" * (3 + len(ts)) + "|"]
    for name, r in lays.items():
        cells = [f"{r['accuracy'][str(t)]:.2f} · {r['cache_bytes'][str(t)] / 2 ** 20:.2f} MiB" for t in ts]
        rows.append(f"| {name} | {r['params']:,} | {r['final_loss']:.3f} | " + " | ".join(cells) + " |")
    return "\n".join([
        f"Measured {report['date']} on {report['machine']} (`docs/data/hybrid_retrieval.json`, plot "
        "`docs/data/hybrid_retrieval.png`). Each layout: "
        f"{report['steps']} steps of {report['batch_size']} rows × {report['seq_len']} tokens (lr {report['lr']}), "
        f"width {report['width']}, one training document of {report['min_keys']}–{report['keys']} facts per row, "
        "cut to a length drawn up to the row, loss on its answered questions only; evaluation: "
        f"{report['eval_seeds']} multi-key items ({report['keys']} facts) "
        f"per length × depth ({', '.join(str(d) for d in report['depths'])}), greedy. "
        "Each cell: exact-match accuracy · decode cache after prefill.", "", *rows, "",
        "By depth of the queried fact (0 = the haystack's start, 1 = its end), exact-match accuracy:", "",
        *depth_rows(lays, ts)])


def eval_harness_randomized_table(rows: list[dict]) -> str:
    return eval_harness_table(rows, "docs/data/eval_harness_randomized.jsonl")


def sustain_table(report: dict) -> str:
    """Per chain length × compaction mode: the model's verifier scores, how long it sustained the
    work and the largest context it was sent, beside the reference solution's scores."""
    rows = ["| N steps (2·N calls) | compaction | model: score per seed | mean | sustained calls per seed "
            "| largest context sent | turns over the limit | reference: score per seed |", "|---" * 8 + "|"]
    for n, modes in report["model"].items():
        for mode, s in modes.items():
            ref = report["reference"][n][mode]
            rows.append(f"| {n} | {mode} | {', '.join(f'{v:.2f}' for v in s['score'])} | {s['mean_score']:.2f} | "
                        f"{', '.join(map(str, s['sustained_calls']))} | {max(s['max_sent_tokens']):,} | "
                        f"{sum(s['over_context_turns'])} | {', '.join(f'{v:.2f}' for v in ref['score'])} |")
    sft = report["sft"]
    return "\n".join([
        f"Measured {report['date']} on {report['machine']} (`docs/data/sustain.json`, plot `docs/data/sustain.png`). "
        f"Model: the agent base after SFT of {sft['steps']} steps of {sft['batch_size']} × {sft['seq_len']} tokens "
        f"(lr {sft['lr']}) on one row per turn of chains of {', '.join(map(str, report['train_steps']))} steps "
        f"({report['train_seeds']} training seeds each), compacted at {report['context_tokens']} tokens. "
        f"Sustain: held-out seeds {report['eval_seeds'][0]}..{report['eval_seeds'][-1]}, LocalEngine, effort "
        f"{report['effort']}, temperature {report['temperature']}, compaction on (at {report['context_tokens']} "
        "tokens, the training limit) and off. Score: the verifier's share of steps right; sustained calls: "
        "the tool call at which progress last rose. Times: "
        + ", ".join(f"{k.removesuffix('_s')} {v:,.0f} s" for k, v in report["times"].items()) + ".", "", *rows])


def depth_rows(lays: dict, ts: list[int]) -> list[str]:
    """The hybrid table's accuracy per layout × depth (rows) and context length (columns)."""
    rows = ["| layout | depth | " + " | ".join(f"T={t}" for t in ts) + " |", "|---" * (2 + len(ts)) + "|"]
    for name, r in lays.items():
        by = r["accuracy_by_depth"]
        for d in sorted(by[str(ts[0])], key=float):
            rows.append(f"| {name} | {d} | " + " | ".join(f"{by[str(t)][d]:.2f}" for t in ts) + " |")
    return rows


def eval_harness_table(rows: list[dict], where: str = "docs/data/eval_harness.jsonl") -> str:
    """Per family × effort: the mean score under each harness seed, the mean over seeds with its
    bootstrap interval over tasks, and the spread (std over seeds); the hack and solution columns."""
    import sys
    sys.path.insert(0, str(ROOT / "src"))
    from k3.rl.eval_tables import harness_spread, summarize

    scores = [r for r in rows if r["metric"] == "score"]
    first = scores[0]
    c = first["conditions"]
    seeds = sorted({r["labels"]["harness"] for r in scores})
    out = [f"Measured {first['date']} on {first['machine']} (`{where}`: every row with its "
           f"conditions). Model {c['model']['name']} ({c['model']['fingerprint']}), temperature "
           f"{c['temperature']}, {c['setup']['max_tokens']} tokens per turn, harness seeds {', '.join(map(str, seeds))}.",
           "", "| family | effort | " + " | ".join(f"seed {s}" for s in seeds)
           + " | mean [95% CI over tasks] | spread (std over seeds) |", "|---" * (4 + len(seeds)) + "|"]
    cell = {}
    for s in summarize([{**r, "labels": {k: v for k, v in r["labels"].items() if k != "harness"}} for r in scores]):
        cell[(s["labels"]["family"], s["labels"]["effort"])] = s
    for sp in harness_spread(scores):
        f, e = sp["labels"]["family"], sp["labels"]["effort"]
        m = cell[(f, e)]
        out.append(f"| {f} | {e} | " + " | ".join(f"{sp['by_harness'].get(s, float('nan')):.2f}" for s in seeds)
                   + f" | {m['mean']:.2f} [{m['lo']:.2f}, {m['hi']:.2f}] | {sp['spread']:.3f} |")
    for metric in ("hack_score", "solution_score"):
        vals = [r["value"] for r in rows if r["metric"] == metric]
        if vals:
            out.append(f"\n{metric}: {sum(vals) / len(vals):.2f} over {len(vals)} transcripts")
    return "\n".join(out)


def last_run(path: Path, bench: str) -> list[dict]:
    """The rows of the last ``bench`` run in a JSON-line file: the final rows sharing its last row's
    config, machine, date and commit."""
    rows = [r for r in (json.loads(x) for x in path.read_text().splitlines() if x.strip()) if r.get("bench") == bench]
    if not rows:
        raise SystemExit(f"{path}: no {bench!r} rows")
    key = lambda r: tuple(r.get(k) for k in ("config", "machine", "date", "commit"))  # noqa: E731
    run = []
    for r in reversed(rows):
        if key(r) != key(rows[-1]):
            break
        run.append(r)
    if rows[-1].get("machine") is None:
        raise SystemExit(f"{path}: the last {bench!r} run has no machine/date stamp (rerun the benchmark)")
    return run[::-1]


def _num(v) -> str:
    if v is None:
        return "—"
    if float(v).is_integer():
        return f"{int(v):,}"
    return f"{v:,.0f}" if abs(v) >= 1000 else f"{v:,.3g}" if abs(v) < 10 else f"{v:,.1f}"


def _stamp(r: dict) -> str:
    return f"{r['machine']}, {r['date']}, commit {r.get('commit') or '?'}"


def _measured(r: dict) -> str:
    """"Measured DATE on MACHINE[, commit C]"."""
    return f"Measured {r['date']} on {r['machine']}" + (f", commit {r['commit']}" if r.get("commit") else "")


def speed_infer_table(rows: list[dict]) -> str:
    infer = [r for r in rows if r["bench"] == "infer"]
    if not infer:
        return "(no benchmarks/infer.py run recorded)"
    out = [f"`benchmarks/infer.py`, {infer[0]['config']}, `--gen {infer[0].get('gen')}`; {_stamp(infer[0])}:", "",
           "| row | value | baseline | ratio | target |", "|---|---:|---:|---:|---|"]
    by = {r["metric"]: r for r in infer}
    for metric, label in INFER_ROWS.items():
        r = by.get(metric)
        if r is not None:
            out.append(f"| {label} | {_num(r['value'])} | {_num(r['baseline'])} | {_num(r['ratio'])} | "
                       f"{r.get('verdict') or ''} |")
    return "\n".join(out)


def speed_train_table(rows: list[dict]) -> str:
    train = [r for r in rows if r["bench"] == "train"]
    if not train:
        return "(no benchmarks/train.py run recorded)"
    out = ["| `train.py --what mfu` | tokens/s | model TFLOP/s | peak matmul TFLOP/s | MFU | measured on |",
           "|---|---:|---:|---:|---:|---|"]
    for r in train:
        out.append(f"| {r['config']} | {_num(r['tokens_per_s'])} | {r['value'] / 1e12:.4f} | "
                   f"{r['baseline'] / 1e12:.4f} | {100 * r['ratio']:.1f}% | {_stamp(r)} |")
    return "\n".join(out)


class Unstamped(ValueError):
    """A row or report without the machine and date it was measured on."""


def require_stamp(rows: list[dict], where: str) -> None:
    """Refuse (``Unstamped``) any row without a ``machine`` and a ``date``."""
    for i, r in enumerate(rows):
        missing = [k for k in ("machine", "date") if not r.get(k)]
        if missing:
            what = " ".join(str(r[k]) for k in ("bench", "metric") if r.get(k)) or "report"
            raise Unstamped(f"{where}: row {i + 1} ({what}) has no {' / '.join(missing)}: figures that do not say "
                            "where and when they were measured are not rendered (rerun the benchmark: "
                            "benchmarks/_timing.append_results stamps its rows)")


def read_rows(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def last_runs(path: Path) -> list[dict]:
    """The rows of the last run in a benchmark's JSON-line file: those sharing its last row's ``run``
    id (``benchmarks/_timing.measured_on``); refused (``Unstamped``) when that run is not stamped."""
    rows = read_rows(path)
    if not rows:
        raise SystemExit(f"{path}: no rows")
    last = rows[-1]
    require_stamp([last], str(path))
    if last.get("run") is None:
        raise Unstamped(f"{path}: the last row has no run id (written before benchmarks/_timing.py stamped "
                        "runs): rerun the benchmark")
    run = [r for r in rows if r.get("run") == last["run"]]
    require_stamp(run, str(path))
    return run


def _stamps(rows: list[dict]) -> str:
    return "; ".join(dict.fromkeys(_stamp(r) for r in rows))


def _g3(v: float) -> str:
    """Three significant digits, no exponent below 1000 (14.9, 42.3, 215, 1,416)."""
    return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.3g}"


def _x(r: float | None) -> str:
    if r is None:
        return "—"
    return f"{r:,.0f}×" if r >= 10 else f"{r:.3g}×"


def _e(v: float) -> str:
    """1.8e7."""
    m, e = f"{v:.1e}".split("e")
    return f"{m}e{int(e)}"


def _threads(rows: list[dict]) -> str:
    """", 2 threads": the thread counts of the rows (a row's own ``threads``, else its config's)."""
    ts = set()
    for r in rows:
        cfg = r["config"] if isinstance(r.get("config"), dict) else {}
        ts.add(r.get("threads", cfg.get("threads")))
    ts = sorted(ts - {None})
    return f", {'/'.join(map(str, ts))} thread{'s' if ts != [1] else ''}" if ts else ""


def _model_case(r: dict) -> dict:
    """benchmarks/model.py's config string ``PRESET B=b T=t threads=n case=C`` as fields."""
    m = re.match(r"(\S+) B=(\d+) T=(\d+) threads=(\d+) case=(\S+)", r["config"])
    return {} if m is None else {"preset": m[1], "batch": int(m[2]), "seq": int(m[3]), "threads": int(m[4]),
                                 "case": m[5]}


def micro_table(rows: list[dict]) -> str:
    """The README's "Measured" table: one row per figure of kda.py, model.py, moe.py, checkpoint.py and
    mx.py, each with the machine, date and commit of the rows it comes from."""
    require_stamp(rows, "micro")
    out = ["| benchmark | figure | baseline | ratio | measured on |", "|---|---|---|---|---|"]

    def line(bench, figure, baseline, ratio, rs):
        out.append(f"| {bench} | {figure} | {baseline} | {ratio} | {_stamps(rs)} |")

    kda = [r for r in rows if r["bench"] == "kda"]
    T = lambda r: r["config"]["T"]  # noqa: E731
    for metric, what in (("chunk_fwd", "fwd"), ("chunk_fwd_bwd", "fwd+bwd")):
        rs = sorted((r for r in kda if r["metric"] == metric and r.get("baseline_name", "").startswith("recurrent")),
                    key=T)
        if rs:
            c = rs[0]["config"]
            ext = sorted({r["config"]["extrapolated_from"] for r in rs if "extrapolated_from" in r["config"]})
            base = "recurrent_kda" + (f" (timed on the first {ext[0]} tokens, × T/{ext[0]})" if ext else "")
            line(f"`kda.py` chunk_kda {what}, B={c['B']} H={c['H']} D={c['D']}{_threads(rs)}, "
                 f"T={' / '.join(str(T(r)) for r in rs)}",
                 " / ".join(_g3(r["value"] * 1e3) for r in rs) + " ms", base, " / ".join(_x(r["ratio"]) for r in rs), rs)
    for t in sorted({T(r) for r in kda if r["metric"].endswith("_scaling")}):
        rs = [r for r in kda if r["metric"].endswith("_scaling") and T(r) == t]
        vs = rs[0]["config"]["vs_T"]
        figs = ", ".join(f"{'fwd+bwd' if r['metric'].startswith('chunk_fwd_bwd') else 'fwd'} {_x(r['ratio'])}"
                         for r in sorted(rs, key=lambda r: r["metric"].startswith("chunk_fwd_bwd")))
        line(f"`kda.py` growth T={t} vs {vs}", figs, f"linear = {t / vs:g}×", "", rs)

    model = [{**_model_case(r), **r} for r in rows if r["bench"] == "model"]
    by = {(r.get("case"), r["metric"]): r for r in model}
    f, b, rss = (by.get(("k3", m)) for m in ("forward_tokens_per_s", "forward_backward_tokens_per_s", "peak_rss_mb"))
    if f and b:
        n = f.get("params")
        params = "" if not n else f" ({n / 1e6:.0f}M params)" if n >= 1e7 else f" ({_g3(n / 1e6)}M params)"
        mem = f", peak RSS {rss['value'] / 1024:.1f} GiB" if rss else ""
        line(f"`model.py` `{f['preset']}`{params}, B={f['batch']} T={f['seq']}{_threads([f])}",
             f"fwd {f['value']:,.0f} tok/s, fwd+bwd {b['value']:,.0f} tok/s{mem}", "—", "—",
             [r for r in (f, b, rss) if r])
    f, b = by.get(("k3-kl", "forward_tokens_per_s")), by.get(("k3-kl", "forward_backward_tokens_per_s"))
    if f and b:
        line(f"`model.py` Kimi-Linear mode of `{f['preset']}` vs transformers `kimi_linear` (same math)",
             f"fwd {f['value']:,.0f}, fwd+bwd {b['value']:,.0f} tok/s",
             f"{f['baseline']:,.0f} / {b['baseline']:,.0f} tok/s", f"{_x(f['ratio'])} / {_x(b['ratio'])}", [f, b])

    for r in (r for r in rows if r["bench"] == "moe" and r["config"].endswith("sorted grouped_mm")):
        preset, n = r["config"].split()[:2]
        line(f"`moe.py` `{preset}` MoE fwd+bwd, {n}{_threads([r])}", f"sort + `grouped_mm` {r['value']:.2g} s",
             f"per-expert loop {r['baseline']:.2g} s", _x(r["ratio"]), [r])

    ck = {r["metric"]: r for r in rows if r["bench"] == "checkpoint"}
    names = (("save_MBps", "save"), ("load_MBps", "load into a model"), ("build_and_load_MBps", "build + load"))
    rs = [ck[m] for m, _ in names if m in ck]
    if rs:
        preset, dtype = rs[0]["config"].split("/")
        line(f"`checkpoint.py` `{preset}` {dtype} ({_g3(rs[0]['size_MB'])} MB): "
             + " / ".join(w for m, w in names if m in ck),
             " / ".join(f"{r['value']:,.0f}" for r in rs) + " MB/s", "`torch.save` / `torch.load`",
             " / ".join(_x(r["ratio"]) for r in rs), rs)

    mx = [r for r in rows if r["bench"] == "mx"]
    rs = [r for r in mx if r["metric"] == "elements_per_s"]
    if rs:
        fmts = [MX_LABELS.get(f, f) for f in (r.get("fmt") or r["config"].split()[1] for r in rs)]
        line(f"`mx.py` quantize {' / '.join(fmts)}{_threads(rs)}", " / ".join(_e(r["value"]) for r in rs)
             + " elements/s", "per-block Python loop", " / ".join(_x(r["ratio"]) for r in rs), rs)
    for r in (r for r in mx if r["metric"] == "bytes packed_mxfp4 vs bf16"):
        line(f"`mx.py` `{r['config'].split()[0]}` routed experts packed MXFP4", f"{r['value'] / 1e6:.1f} MB",
             f"bf16 {r['baseline'] / 1e6:.1f} MB", f"{r['ratio']:.3f} (= 4.25/16)", [r])
    for r in (r for r in mx if r["metric"] == "tokens_per_s packed vs unpacked"):
        line(f"`mx.py` `{r['config'].split()[0]}` decode, batch 1{_threads([r])}", f"packed {r['value']:.2g} tok/s",
             f"unpacked {r['baseline']:.3g} tok/s", _x(r["ratio"]), [r])
    return "\n".join(out)


def demo_table(report: dict) -> str:
    """The README's demo paragraph and table from a ``k3 demo`` report (``runs/demo/report.json``)."""
    require_stamp([report], "demo")
    c, m, v, t = report["corpus"], report["model"], report["validation"], report["times"]
    corpus = f"Python {report['python']}'s stdlib" if c["name"].startswith("stdlib:") else f"corpus {c['name']}"
    cvs = ", ".join(f"{w['mean']:.2f} over steps {w['first']}–{w['last']}" for w in report["load_cv"])
    total = f"{int(t['total_s'] // 60)}:{int(t['total_s'] % 60):02d}"
    used = report.get("threads_used") or []
    threads = f"`--threads {report['threads']}`" + (f" ({'/'.join(map(str, used))} thread{'s' if used != [1] else ''} "
                                                   "used)" if used else "")
    setup = ("" if t.get("setup_s") is None else
             f"; setup (corpus, tokenizer, token cache, model) {t['setup_s']:.0f} s")
    width = f" of width {m['hidden_size']}" if m.get("hidden_size") else ""
    out = [
        f"{_measured(report)} (`docs/data/demo.json`). {corpus}: {c['train_files']:,} training files / "
        f"{c['train_bytes'] / 1e6:.1f} MB, {c['validation_files']:,} validation files / "
        f"{c['validation_bytes'] / 1e3:,.0f} KB; `{m['preset']}` cut to {m['layers']} layers{width} ({m['kda_layers']} KDA + "
        f"{m['mla_layers']} MLA), {m['params'] / 1e6:.1f}M parameters, {report['steps']} steps of "
        f"{report['batch_size']}×{report['seq_len']} tokens, {threads}:",
        "", "| | |", "|---|---|",
        f"| validation, whole split ({v['val_tokens']:,} tokens, {v['val_bytes']:,} bytes) | "
        f"**{v['val_bpb']:.3f} bits per byte** ({v['val_loss']:.3f} nats/token) |",
        *(f"| {name} on the same text | {v:.3f} bits per byte |" for name, v in report["compressors"].items()),
        f"| training time / throughput | {t['train_s'] / 60:.1f} min{' (setup included)' if not setup else ''} at "
        f"{report['train_tokens_per_s']:,.0f} training tokens/s{setup}; {total} for the whole `k3 demo` with the "
        "whole-split evaluation and samples |",
        f"| expert load | load CV (mean over steps) {cvs} under Quantile Balancing |" if cvs else
        "| expert load | (no load CV recorded) |",
    ]
    if report.get("plotted"):
        p = report["plotted"]
        out += ["", f"The plotted evaluations score the same first {p['val_tokens']:,} validation tokens each time "
                    f"({p['val_bpb']:.3f} bits/byte at the end); the headline figure is the whole split."]
    return "\n".join(out)


def ablations_table(rows: list[dict]) -> str:
    """The README's ablations table from one run of benchmarks/ablations.py: per switch, the K3 choice
    (first, in bold with the figure its group is judged by) and the variants."""
    require_stamp(rows, "ablations")
    s = rows[0]["settings"]
    out = [f"`benchmarks/ablations.py`: `k3 train --preset {s['preset']}`, {s['steps']} steps of "
           f"{s['batch_size']}×{s['seq_len']} tokens, lr {s['lr']:g}, same data and seed; whole-split validation. "
           f"{_measured(rows[0])} (`docs/data/ablations.jsonl`):", "",
           "| switch | variant | val loss | val bits/byte | final load CV |", "|---|---|---|---|---|"]
    groups = list(dict.fromkeys(r["group"] for r in rows))
    for g in groups:
        rs = [r for r in rows if r["group"] == g]
        for i, r in enumerate(rs):
            by_cv = r["metric"] == "load_cv"   # the balance group is judged by the load CV, the others by val
            cells = [ABLATION_LABELS.get(g, g) if i == 0 else "", ABLATION_LABELS.get(r["variant"], r["variant"]),
                     f"{r['val_loss']:.3f}", f"{r['val_bpb']:.3f}",
                     "—" if r.get("load_cv") is None else f"{r['load_cv']:.3f}"]
            if i == 0:   # the K3 choice, and the figure its group is judged by
                for k in (1, 4) if by_cv else (1, 2, 3):
                    cells[k] = f"**{cells[k]}**"
            out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def scaling_table(report: dict) -> str:
    """docs/SCALING.md from benchmarks/scaling.py's JSON: the lr scans and seed spread, every grid run,
    the fitted curves and the compute multipliers against the dense baseline."""
    require_stamp([report], "scaling")
    g, runs = report["grid"], report["runs"]
    grid = [r for r in runs if not r["scan"] and not r["seed"]]
    variants = [v for v in report["variants"] if any(r["variant"] == v for r in runs)]
    steps = sorted({r["steps"] for r in grid})
    out = [f"{_measured(report)} (`docs/data/scaling.json`, plot `docs/scaling.png`). Batch {g['batch']} × "
           f"{g['seq_len']} tokens; bits per byte on the whole validation split; C in model FLOPs.", "",
           "**Learning rate scans** (width {0}, {1} steps; the lowest is used for the variant's grid):".format(*g["middle"]),
           ""]
    for v in variants:
        scan = sorted((r for r in runs if r["variant"] == v and r["scan"]), key=lambda r: r["lr"])
        if scan:
            best = min(scan, key=lambda r: r["val_bpb"])
            out.append(f"- {v}: " + ", ".join(("**{}**" if r is best else "{}").format(f"lr {r['lr']:g} → {r['val_bpb']:.4f}")
                                              for r in scan))
    sp = report.get("seed_spread", {})
    per = ", ".join(f"{v} {x:.4f}" for v, x in sp.get("per_variant", {}).items())
    out += ["", (f"**Seed spread** at the middle point (std of bits/byte over seeds {', '.join(map(str, sp['paired_seeds']))}"
                 f" of the same runs: {per}). A seed reorders the training documents for every variant alike, and "
                 "that part cancels in a comparison; what is left, the std of the paired difference k3 − dense over "
                 f"seeds over √2, is σ = {report['sigma']:.4f} bits/byte: the noise the bootstrap draws per run.")
            if report.get("sigma") is not None else "**Seed spread**: not measured (no paired extra-seed runs): "
            "no intervals.", "",
            "**Runs** (bits per byte; FLOPs in brackets):", "",
            "| variant | width | activated params | " + " | ".join(f"{s} steps ({s * g['batch'] * g['seq_len']:,} tokens)"
                                                          for s in steps) + " |",
            "|---|---:|---:|" + "---:|" * len(steps)]
    for v in variants:
        for w in sorted({r["width"] for r in grid if r["variant"] == v}):
            by = {r["steps"]: r for r in grid if r["variant"] == v and r["width"] == w}
            act = next(iter(by.values()))["activated_params"]
            out.append(f"| {v} | {w} | {act:,} | " + " | ".join(
                f"{by[s]['val_bpb']:.4f} ({_e(by[s]['flops'])})" if s in by else "—" for s in steps) + " |")
    out += ["", "**Fits and multipliers.** Each variant's compute-efficient frontier (the runs no cheaper run "
                "beats) is fitted with L(C) = E + A·C^−α. The multiplier against `dense` is read at L*, the lowest "
                "loss both frontiers reach, from the frontiers themselves (linear in log C between the two runs "
                "around L*, no extrapolation): C_dense(L*) / C_variant(L*), above 1 when the variant needs less "
                "compute. The fitted curves' ratio at the same L* is beside it; α's interval is the bootstrap's.", "",
            "| variant | frontier runs | E | A | α | L* | C_dense(L*) | C_variant(L*) | × dense [95% interval] | × from the fits |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---|---:|"]
    at_zero = []
    for v in variants:
        f = report["fits"].get(v)
        if f is None:
            continue
        if "error" in f:
            out.append(f"| {v} | {len(f['frontier'])} | no fit: {f['error']} |" + " |" * 7)
            continue
        if f.get("E_at_zero"):
            at_zero.append(v)
        m = report["multipliers"].get(v)
        if m is None:
            cells = ["—"] * 5 if v != "dense" else ["", "", "", "1 (the baseline)", ""]
        else:
            ci = m.get("ci95")
            cells = [f"{m['target_bpb']:.4f}", _e(m["compute_base"]) if m["compute_base"] else "—",
                     _e(m["compute"]) if m["compute"] else "—",
                     (_x(m["multiplier"]) if m["multiplier"] is not None else "—")
                     + (f" [{_x(ci[0])}, {_x(ci[1])}]" if ci else ""),
                     _x(m.get("fit_multiplier"))]
        aci = f.get("alpha_ci95")
        alpha = f"{f['alpha']:.4f}" + (f" [{aci[0]:.3f}, {aci[1]:.3f}]" if aci else "")
        out.append(f"| {v} | {f['points']} | {f['E']:.3f} | {f['A']:.4g} | {alpha} | " + " | ".join(cells) + " |")
    if at_zero:
        out += ["", f"E = 0 for {', '.join(at_zero)}: the least-squares E sits at the bottom of its range, i.e. these "
                    "frontiers still bend downwards in log-log and show no irreducible loss at this scale. There the "
                    "fitted form is a description of the measured range, and the frontier multiplier is the figure to read."]
    return "\n".join(out)


def replace_block(doc: Path, name: str, body: str) -> None:
    text = doc.read_text()
    pat = re.compile(rf"(<!-- {name}:begin -->\n).*?(<!-- {name}:end -->)", re.S)
    if not pat.search(text):
        raise SystemExit(f"{doc}: no <!-- {name}:begin --> ... <!-- {name}:end --> markers")
    doc.write_text(pat.sub(lambda m: m.group(1) + body + "\n" + m.group(2), text))


def save_micro(files: list[Path], dst: Path = MICRO) -> list[dict]:
    """The last run in each benchmark JSON-line file (``last_runs``) written to ``dst`` in place of
    that benchmark's rows there (the other benchmarks' rows stay). Returns the new rows."""
    rows = [r for f in files for r in last_runs(Path(f))]
    _merge(dst, rows)
    return rows


def _merge(dst: Path, rows: list[dict]) -> None:
    """Write ``rows`` to the JSON-line file ``dst``, after the rows already there of other benches."""
    benches = {r["bench"] for r in rows}
    kept = [r for r in read_rows(dst) if r["bench"] not in benches] if dst.exists() else []
    dst.parent.mkdir(parents=True, exist_ok=True)
    dst.write_text("".join(json.dumps(r) + "\n" for r in kept + rows))


def save_report(src: Path, dst: Path) -> dict:
    """A report (``k3 demo``'s) copied to ``dst`` once it names its machine and date."""
    report = json.loads(Path(src).read_text())
    require_stamp([report], str(src))
    dst.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(src, dst)
    return report


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--save", help="a k3 agent-demo report.json to record as docs/data/agent_demo.json first")
    p.add_argument("--save-rl", help="a benchmarks/rl_demo.py report.json to record as docs/data/rl_demo.json first")
    p.add_argument("--save-rl-low-lr", help="a benchmarks/rl_demo.py report.json of a run at a lower --lr to record "
                                            "as docs/data/rl_demo_low_lr.json first")
    p.add_argument("--save-rl-arith", help="a benchmarks/rl_demo.py --only arith:N report.json to record as "
                                           "docs/data/rl_demo_arith.json first")
    p.add_argument("--save-distill", help="a benchmarks/distill_demo.py report.json to record as "
                                          "docs/data/distill_demo.json first")
    p.add_argument("--save-distill-120", help="a benchmarks/distill_demo.py --steps 120 report.json to record as "
                                              "docs/data/distill_demo_steps120.json first")
    p.add_argument("--save-distill-arith", help="a benchmarks/distill_demo.py --families arith report.json to "
                                                "record as docs/data/distill_demo_arith.json first")
    p.add_argument("--save-hybrid", help="a benchmarks/hybrid_retrieval.py report.json (its plot beside it) to "
                                         "record as docs/data/hybrid_retrieval.json / .png first")
    p.add_argument("--save-sustain", help="a benchmarks/sustain.py report.json (its plot beside it) to record as "
                                          "docs/data/sustain.json / .png first")
    p.add_argument("--save-eval", help="a k3 eval harness run folder whose rows.jsonl to record as "
                                       "docs/data/eval_harness.jsonl first")
    p.add_argument("--save-eval-randomized", help="a k3 eval harness run folder of the agent demo's model "
                                                  "fine-tuned under randomized harnesses, recorded as "
                                                  "docs/data/eval_harness_randomized.jsonl first")
    p.add_argument("--save-vision", help="a k3 vision-demo report.json to record as docs/data/vision_demo.json first")
    p.add_argument("--save-speed", nargs="+", metavar="JSONL",
                   help="benchmarks/results/infer.jsonl and/or train.jsonl: their last runs recorded as "
                        "docs/data/speed.jsonl first")
    p.add_argument("--save-micro", nargs="+", metavar="JSONL",
                   help="benchmarks/results/{kda,model,moe,checkpoint,mx}.jsonl: the last run in each recorded as "
                        "docs/data/micro.jsonl first")
    p.add_argument("--save-demo", help="a k3 demo report.json to record as docs/data/demo.json first")
    p.add_argument("--save-ablations", metavar="JSONL", help="benchmarks/results/ablations.jsonl: its last run "
                                                             "recorded as docs/data/ablations.jsonl first")
    p.add_argument("--root", help="read and write DIR/docs/data, DIR/README.md and DIR/docs/*.md instead of the "
                                  "repository's (a dry run on a copy)")
    return p


def main() -> int:
    a = parser().parse_args()
    try:
        render_all(a, Path(a.root).resolve() if a.root else ROOT)
    except Unstamped as e:
        raise SystemExit(f"docs_tables: {e}")
    return 0


def under(root: Path, path: Path) -> Path:
    """``path`` (a path of this checkout) at the same place under ``root``."""
    return root / path.relative_to(ROOT)


def render_all(a: argparse.Namespace, root: Path) -> None:
    at = functools.partial(under, root)

    def rel(path: Path) -> str:
        return str(path.relative_to(root))

    speed, eval_rows, micro, ablations = at(SPEED), at(EVAL_ROWS), at(MICRO), at(ABLATIONS)
    if a.save_speed:   # in place of those benches' rows (infer, train); the other's stay
        rows = []
        for f in map(Path, a.save_speed):
            bench = "train" if f.stem == "train" else "infer"
            rows += last_run(f, bench)
        _merge(speed, rows)
    if a.save_micro:
        save_micro(a.save_micro, micro)
    if a.save_ablations:   # one run: the table's rows
        rows = last_runs(Path(a.save_ablations))
        ablations.parent.mkdir(parents=True, exist_ok=True)
        ablations.write_text("".join(json.dumps(r) + "\n" for r in rows))
    if a.save_demo:
        save_report(Path(a.save_demo), at(DEMO_DATA))
    for src, dst in ((a.save_eval, eval_rows), (a.save_eval_randomized, at(EVAL_ROWS_RANDOMIZED))):
        if src:
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(Path(src) / "rows.jsonl", dst)
    for src, dst in ((a.save, DATA), (a.save_rl, RL_DATA), (a.save_rl_low_lr, RL_LOW_LR_DATA),
                     (a.save_rl_arith, RL_ARITH_DATA),
                     (a.save_distill, DISTILL_DATA),
                     (a.save_distill_120, DISTILL_LONG_DATA), (a.save_distill_arith, DISTILL_ARITH_DATA),
                     (a.save_hybrid, HYBRID_DATA),
                     (a.save_vision, VISION_DATA), (a.save_sustain, SUSTAIN_DATA)):
        if src:
            require_stamp([json.loads(Path(src).read_text())], str(src))
            at(dst).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src, at(dst))
    if a.save_hybrid:
        shutil.copyfile(Path(a.save_hybrid).parent / "hybrid_retrieval.png", at(HYBRID_DATA).with_suffix(".png"))
    if a.save_sustain:
        shutil.copyfile(Path(a.save_sustain).parent / "sustain.png", at(SUSTAIN_DATA).with_suffix(".png"))
    for data, doc, block, render, reader in blocks(root):
        if data.exists():
            replace_block(doc, block, render(reader(data)))
            print(f"wrote the {block} table of {rel(doc)} from {rel(data)}")


def read_report(path: Path) -> dict:
    return json.loads(path.read_text())


def blocks(root: Path = ROOT) -> list[tuple]:
    """(data, doc, block, render, reader) of every generated table, with paths under ``root``: the
    table is ``render(reader(data))``, written between the block's markers in ``doc`` when ``data``
    exists."""
    at = functools.partial(under, root)

    return [
        (at(SPEED), at(INFER_DOC), "speed_infer", speed_infer_table, read_rows),
        (at(SPEED), at(README), "speed_infer", speed_infer_table, read_rows),
        (at(SPEED), at(README), "speed_train", speed_train_table, read_rows),
        (at(DATA), at(DOC), "agent_demo", agent_demo_table, read_report),
        (at(RL_DATA), at(RL_DOC), "rl_demo", rl_demo_table, read_report),
        (at(RL_LOW_LR_DATA), at(RL_DOC), "rl_demo_low_lr", rl_demo_low_lr_table, read_report),
        (at(RL_ARITH_DATA), at(RL_DOC), "rl_demo_arith", rl_demo_arith_table, read_report),
        (at(DISTILL_DATA), at(DISTILL_DOC), "distill_demo", distill_demo_table, read_report),
        (at(DISTILL_LONG_DATA), at(DISTILL_DOC), "distill_demo_steps120", distill_demo_long_table, read_report),
        (at(DISTILL_ARITH_DATA), at(DISTILL_DOC), "distill_demo_arith", distill_demo_arith_table, read_report),
        (at(EVAL_ROWS), at(EVAL_DOC), "eval_harness", eval_harness_table, read_rows),
        (at(EVAL_ROWS_RANDOMIZED), at(EVAL_DOC), "eval_harness_randomized", eval_harness_randomized_table,
         read_rows),
        (at(MICRO), at(README), "micro", micro_table, read_rows),
        (at(DEMO_DATA), at(README), "demo", demo_table, read_report),
        (at(ABLATIONS), at(README), "ablations", ablations_table, read_rows),
        (at(VISION_DATA), at(VISION_DOC), "vision_demo", vision_demo_table, read_report),
        (at(HYBRID_DATA), at(EVAL_DOC), "hybrid_retrieval", hybrid_table, read_report),
        (at(SUSTAIN_DATA), at(EVAL_DOC), "sustain", sustain_table, read_report),
        (at(SCALING_DATA), at(SCALING_DOC), "scaling", scaling_table, read_report),
    ]


if __name__ == "__main__":
    raise SystemExit(main())
