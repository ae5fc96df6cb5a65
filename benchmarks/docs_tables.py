"""Write the docs' generated tables from committed benchmark data (never typed in by hand).

Each table lives between ``<!-- NAME:begin -->`` and ``<!-- NAME:end -->`` in a docs file and is
rendered from a JSON record under ``docs/data/`` that carries its machine and date:

- ``agent_demo`` (docs/POSTTRAINING.md) from ``docs/data/agent_demo.json``, the report of one
  ``k3 agent-demo`` run (``runs/agent-demo/report.json`` copied there by ``--save``);
- ``rl_demo`` (docs/RL.md) from ``docs/data/rl_demo.json``, the report of one
  ``benchmarks/rl_demo.py`` run (``runs/rl-demo/report.json`` copied there by ``--save-rl``);
- ``eval_harness`` (docs/EVAL.md) from ``docs/data/eval_harness.jsonl``, the rows of one
  ``k3 eval harness`` run (``RUN/rows.jsonl`` copied there by ``--save-eval RUN``);
- ``hybrid_retrieval`` (docs/EVAL.md) from ``docs/data/hybrid_retrieval.json``, the report of one
  ``benchmarks/hybrid_retrieval.py`` run (``runs/hybrid/report.json`` and its plot copied there
  by ``--save-hybrid``);
- ``vision_demo`` (docs/VISION.md) from ``docs/data/vision_demo.json``, the report of one
  ``k3 vision-demo`` run (``runs/vision-demo/report.json`` copied there by ``--save-vision``);
- ``speed_infer`` (docs/INFERENCE.md, README.md) and ``speed_train`` (README.md) from
  ``docs/data/speed.jsonl``: the last run of ``benchmarks/infer.py`` and of ``benchmarks/train.py
  --what mfu`` in the JSON-line files given to ``--save-speed`` (each row stamped with its machine,
  date and commit by ``benchmarks/_timing.py``).

    python benchmarks/docs_tables.py [--save runs/agent-demo/report.json] [--save-rl runs/rl-demo/report.json]
                                     [--save-hybrid runs/hybrid/report.json] [--save-eval RUN]
                                     [--save-vision runs/vision-demo/report.json]
                                     [--save-speed benchmarks/results/infer.jsonl benchmarks/results/train.jsonl]
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "docs" / "data" / "agent_demo.json"
DOC = ROOT / "docs" / "POSTTRAINING.md"
RL_DATA = ROOT / "docs" / "data" / "rl_demo.json"
RL_DOC = ROOT / "docs" / "RL.md"
HYBRID_DATA = ROOT / "docs" / "data" / "hybrid_retrieval.json"
EVAL_DOC = ROOT / "docs" / "EVAL.md"
EVAL_ROWS = ROOT / "docs" / "data" / "eval_harness.jsonl"
SPEED = ROOT / "docs" / "data" / "speed.jsonl"
VISION_DATA = ROOT / "docs" / "data" / "vision_demo.json"
VISION_DOC = ROOT / "docs" / "VISION.md"
INFER_DOC = ROOT / "docs" / "INFERENCE.md"
README = ROOT / "README.md"
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


def rl_demo_table(report: dict) -> str:
    """Held-out pass rates before (SFT) and after RL per family × effort, the spread over harness
    seeds, the reward curve in brief, speeds and times."""
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
        f"Measured {report['date']} on {report['machine']} (`docs/data/rl_demo.json`).",
        f"RL: {rl['steps']} steps in {t['rl_s'] / 60:.1f} min (budget {rl['minutes']:g} min), groups of "
        f"{rl['group']}, {rl['tasks_per_step']} tasks per step, lr {rl['lr']}, effort {rl['effort']}, "
        f"temperature {rl['temperature']}, harness randomization on, {rl['workers']} rollout workers; tasks "
        f"{', '.join(rl['tasks'])}. Evaluation: {ev['heldout']} held-out tasks per cell, greedy, canonical "
        f"harness; the spread at effort {ev['spread_effort']} over {ev['harness_seeds']} harness seeds.",
        f"Sampling {sp['sampled_tokens_per_s']:.0f} tokens/s ({sp['sampled_tokens']:,} tokens), training "
        f"{sp['trained_tokens_per_s']:.0f} tokens/s ({sp['trained_tokens']:,.0f} tokens). Times: {times}.",
        f"Mean reward by step: {pts}.", "", *rows, "", *spread])


def hybrid_table(report: dict) -> str:
    """Multi-key accuracy and decode cache per layout and context length, with the training run."""
    lays = report["layouts"]
    ts = sorted({int(t) for r in lays.values() for t in r["accuracy"]})
    head = "| layout | parameters | final train loss | " + " | ".join(f"T={t}" for t in ts) + " |"
    rows = [head, "|---" * (3 + len(ts)) + "|"]
    for name, r in lays.items():
        cells = [f"{r['accuracy'][str(t)]:.2f} · {r['cache_bytes'][str(t)] / 2 ** 20:.2f} MiB" for t in ts]
        rows.append(f"| {name} | {r['params']:,} | {r['final_loss']:.3f} | " + " | ".join(cells) + " |")
    return "\n".join([
        f"Measured {report['date']} on {report['machine']} (`docs/data/hybrid_retrieval.json`, plot "
        "`docs/data/hybrid_retrieval.png`). Each layout: "
        f"{report['steps']} steps of {report['batch_size']} × {report['seq_len']} tokens "
        f"(lr {report['lr']}) on {report['docs']} documents of {report['words']} filler words and "
        f"{report['keys']} facts; evaluation: {report['eval_seeds']} multi-key items ({report['keys']} facts) "
        f"per length × depth ({', '.join(str(d) for d in report['depths'])}), greedy. "
        "Each cell: exact-match accuracy · decode cache after prefill.", "", *rows])


def eval_harness_table(rows: list[dict]) -> str:
    """Per family × effort: the mean score under each harness seed, the mean over seeds with its
    bootstrap interval over tasks, and the spread (std over seeds); the hack and solution columns."""
    import sys
    sys.path.insert(0, str(ROOT / "src"))
    from k3.rl.eval_tables import harness_spread, summarize

    scores = [r for r in rows if r["metric"] == "score"]
    first = scores[0]
    c = first["conditions"]
    seeds = sorted({r["labels"]["harness"] for r in scores})
    out = [f"Measured {first['date']} on {first['machine']} (`docs/data/eval_harness.jsonl`: every row with its "
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


def replace_block(doc: Path, name: str, body: str) -> None:
    text = doc.read_text()
    pat = re.compile(rf"(<!-- {name}:begin -->\n).*?(<!-- {name}:end -->)", re.S)
    if not pat.search(text):
        raise SystemExit(f"{doc}: no <!-- {name}:begin --> ... <!-- {name}:end --> markers")
    doc.write_text(pat.sub(lambda m: m.group(1) + body + "\n" + m.group(2), text))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--save", help="a k3 agent-demo report.json to record as docs/data/agent_demo.json first")
    p.add_argument("--save-rl", help="a benchmarks/rl_demo.py report.json to record as docs/data/rl_demo.json first")
    p.add_argument("--save-hybrid", help="a benchmarks/hybrid_retrieval.py report.json (its plot beside it) to "
                                         "record as docs/data/hybrid_retrieval.json / .png first")
    p.add_argument("--save-eval", help="a k3 eval harness run folder whose rows.jsonl to record as "
                                       "docs/data/eval_harness.jsonl first")
    p.add_argument("--save-vision", help="a k3 vision-demo report.json to record as docs/data/vision_demo.json first")
    p.add_argument("--save-speed", nargs="+", metavar="JSONL",
                   help="benchmarks/results/infer.jsonl and/or train.jsonl: their last runs recorded as "
                        "docs/data/speed.jsonl first")
    a = p.parse_args()
    if a.save_speed:
        rows = []
        for f in map(Path, a.save_speed):
            bench = "train" if f.stem == "train" else "infer"
            rows += last_run(f, bench)
        SPEED.parent.mkdir(parents=True, exist_ok=True)
        SPEED.write_text("".join(json.dumps(r) + "\n" for r in rows))
    if a.save_eval:
        EVAL_ROWS.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(Path(a.save_eval) / "rows.jsonl", EVAL_ROWS)
    for src, dst in ((a.save, DATA), (a.save_rl, RL_DATA), (a.save_hybrid, HYBRID_DATA), (a.save_vision, VISION_DATA)):
        if src:
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src, dst)
    if a.save_hybrid:
        shutil.copyfile(Path(a.save_hybrid).parent / "hybrid_retrieval.png", HYBRID_DATA.with_suffix(".png"))
    replace_block(DOC, "agent_demo", agent_demo_table(json.loads(DATA.read_text())))
    print(f"wrote the agent_demo table of {DOC.relative_to(ROOT)} from {DATA.relative_to(ROOT)}")
    if RL_DATA.exists():
        replace_block(RL_DOC, "rl_demo", rl_demo_table(json.loads(RL_DATA.read_text())))
        print(f"wrote the rl_demo table of {RL_DOC.relative_to(ROOT)} from {RL_DATA.relative_to(ROOT)}")
    if EVAL_ROWS.exists():
        rows = [json.loads(x) for x in EVAL_ROWS.read_text().splitlines() if x.strip()]
        replace_block(EVAL_DOC, "eval_harness", eval_harness_table(rows))
        print(f"wrote the eval_harness table of {EVAL_DOC.relative_to(ROOT)} from {EVAL_ROWS.relative_to(ROOT)}")
    if SPEED.exists():
        rows = [json.loads(x) for x in SPEED.read_text().splitlines() if x.strip()]
        replace_block(INFER_DOC, "speed_infer", speed_infer_table(rows))
        replace_block(README, "speed_infer", speed_infer_table(rows))
        replace_block(README, "speed_train", speed_train_table(rows))
        print(f"wrote the speed tables of {INFER_DOC.relative_to(ROOT)} and README.md from {SPEED.relative_to(ROOT)}")
    if VISION_DATA.exists():
        replace_block(VISION_DOC, "vision_demo", vision_demo_table(json.loads(VISION_DATA.read_text())))
        print(f"wrote the vision_demo table of {VISION_DOC.relative_to(ROOT)} from {VISION_DATA.relative_to(ROOT)}")
    if HYBRID_DATA.exists():
        replace_block(EVAL_DOC, "hybrid_retrieval", hybrid_table(json.loads(HYBRID_DATA.read_text())))
        print(f"wrote the hybrid_retrieval table of {EVAL_DOC.relative_to(ROOT)} from {HYBRID_DATA.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
