"""``k3 eval report``: one self-contained HTML page (no network: styles inline, figures as data
URIs) and the same figures as PNG files, from one or more ``k3 eval`` runs.

Per run: its conditions (model, effort, temperature, harness seeds, k3 version, machine, date), the
summary table (mean, 95% bootstrap interval, pass@1 / pass@k) and the harness spread. Figures, each
drawn only when a run has its data: score by condition (family × effort), by effort, by harness
seed; long context: latency, cache bytes and peak memory vs context length (accept), retrieval
accuracy vs length per depth (retrieve), progress vs context sent and context vs tool calls with
compaction on and off (sustain).
"""

from __future__ import annotations

import base64
import html
import io
import json
from pathlib import Path

import numpy as np

from k3.rl.eval_rows import EvalRun
from k3.rl.eval_stats import mean_and_ci
from k3.rl.eval_tables import harness_spread, summarize

__all__ = ["write_report"]

CSS = """body{font-family:sans-serif;margin:2em;max-width:1100px}table{border-collapse:collapse;margin:1em 0}
td,th{border:1px solid #bbb;padding:3px 8px;font-size:13px;text-align:right}th{background:#eee}
td.l,th.l{text-align:left}img{max-width:100%;border:1px solid #ddd;margin:0.5em 0}code{background:#f4f4f4}"""


def _agent_rows(run: EvalRun) -> list[dict]:
    return [r for r in run.rows if r["suite"] in ("agent", "harness") and r["metric"] == "score"
            and r["value"] is not None]


def _bar(ax, names, groups_per_run, title, ylabel):
    keys = sorted({k for g in groups_per_run for k in g}, key=str)
    width = 0.8 / max(len(groups_per_run), 1)
    x = np.arange(len(keys))
    for i, (name, groups) in enumerate(zip(names, groups_per_run)):
        means, errs = [], [[], []]
        for k in keys:
            if k in groups:
                s = mean_and_ci(list(groups[k].values()))
                means.append(s["mean"])
                errs[0].append(s["mean"] - s["lo"])
                errs[1].append(s["hi"] - s["mean"])
            else:
                means.append(np.nan)
                errs[0].append(0)
                errs[1].append(0)
        ax.bar(x + i * width, means, width, yerr=errs, capsize=3, label=name)
    ax.set_xticks(x + width * (len(groups_per_run) - 1) / 2, [str(k) for k in keys], rotation=30, ha="right")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=8)


def _by(rows: list[dict], key) -> dict:
    out: dict = {}
    for r in rows:
        out.setdefault(key(r), {}).setdefault(r["item"], []).append(float(r["value"]))
    return out


def _figures(runs: list[EvalRun]) -> dict[str, bytes]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r.name for r in runs]
    figs: dict[str, object] = {}
    agent = [_agent_rows(r) for r in runs]
    if any(agent):
        for fname, key, title in (
                ("score_by_condition", lambda r: f"{r['labels'].get('family')}/{r['labels'].get('effort')}",
                 "score by family / effort"),
                ("score_by_effort", lambda r: r["labels"].get("effort"), "score by reasoning effort"),
                ("score_by_harness", lambda r: "canonical" if r["labels"].get("harness") is None
                 else f"seed {r['labels']['harness']}", "score by harness randomization seed")):
            fig, ax = plt.subplots(figsize=(8, 3.6))
            _bar(ax, names, [_by(rows, key) for rows in agent], title, "mean score (95% CI)")
            figs[fname] = fig
    acc = [[r for r in run.rows if r["suite"] == "accept" and r["value"] is not None] for run in runs]
    if any(acc):
        fig, axes = plt.subplots(1, 3, figsize=(12, 3.6))
        for name, rows in zip(names, acc):
            for ax, metrics, ylabel in ((axes[0], ("prefill_s_per_token", "decode_s_per_token"), "seconds per token"),
                                        (axes[1], ("cache_bytes",), "cache bytes"),
                                        (axes[2], ("peak_rss_bytes",), "peak resident bytes")):
                for m in metrics:
                    pts = sorted((r["labels"]["T"], r["value"]) for r in rows if r["metric"] == m)
                    if pts:
                        ax.plot(*zip(*pts), marker="o", label=f"{name} {m.split('_')[0]}" if len(metrics) > 1
                                else name)
                ax.set_xscale("log", base=2)
                ax.set_xlabel("context length T (tokens)")
                ax.set_ylabel(ylabel)
                ax.legend(fontsize=7)
        axes[0].set_yscale("log")
        axes[0].set_title("accept: latency")
        axes[1].set_title("accept: cache")
        axes[2].set_title("accept: memory")
        figs["accept"] = fig
    ret = [[r for r in run.rows if r["suite"] == "retrieve" and r["value"] is not None] for run in runs]
    if any(ret):
        fig, ax = plt.subplots(figsize=(8, 3.6))
        for name, rows in zip(names, ret):
            for kind in sorted({r["labels"]["kind"] for r in rows}):
                for depth in sorted({r["labels"]["depth"] for r in rows}):
                    sel = [r for r in rows if r["labels"]["kind"] == kind and r["labels"]["depth"] == depth]
                    by_t: dict = {}
                    for r in sel:
                        by_t.setdefault(r["labels"]["T"], []).append(r["value"])
                    pts = sorted((t, sum(v) / len(v)) for t, v in by_t.items())
                    ax.plot(*zip(*pts), marker="o", label=f"{name} {kind} depth {depth}")
        ax.set_xscale("log", base=2)
        ax.set_ylim(-0.05, 1.05)
        ax.set_xlabel("context length T (tokens)")
        ax.set_ylabel("exact-match accuracy")
        ax.set_title("retrieve: accuracy vs length")
        ax.legend(fontsize=7)
        figs["retrieve"] = fig
    sus = [[r for r in run.rows if r["suite"] == "sustain" and r["metric"] == "score"] for run in runs]
    if any(sus):
        fig, axes = plt.subplots(1, 2, figsize=(12, 3.6))
        for name, rows in zip(names, sus):
            for r in rows:
                curve = (r.get("detail") or {}).get("curve") or []
                if not curve:
                    continue
                calls, sent, prog = zip(*curve)
                label = f"{name} {r['item']} compaction {r['labels'].get('compaction')}"
                axes[0].plot(sent, prog, label=label)
                axes[1].plot(calls, sent, label=label)
        axes[0].set_xlabel("context sent (estimated tokens)")
        axes[0].set_ylabel("steps right so far (share)")
        axes[0].set_title("sustain: progress vs context")
        axes[1].set_xlabel("tool calls")
        axes[1].set_ylabel("context sent (estimated tokens)")
        axes[1].set_title("sustain: context vs calls")
        for ax in axes:
            ax.legend(fontsize=7)
        figs["sustain"] = fig
    out = {}
    for name, fig in figs.items():
        buf = io.BytesIO()
        fig.tight_layout()
        fig.savefig(buf, format="png", dpi=90)
        plt.close(fig)
        out[name] = buf.getvalue()
    return out


def _conditions_html(run: EvalRun) -> str:
    rows = run.rows
    c = rows[0]["conditions"]
    seen = lambda f: sorted({json.dumps(r["conditions"].get(f), sort_keys=True) for r in rows})  # noqa: E731
    harness = sorted({json.dumps(r["labels"].get("harness")) for r in rows if "harness" in r["labels"]})
    items = [("suites", ", ".join(run.suites)), ("model", json.dumps(c["model"])),
             ("effort", ", ".join(seen("effort"))), ("temperature", ", ".join(seen("temperature"))),
             ("harness seeds", ", ".join(harness) or "n/a"), ("k3", rows[0]["k3_version"]),
             ("machine", rows[0]["machine"]), ("date", rows[0]["date"]), ("rows", str(len(rows)))]
    return "<table>" + "".join(f"<tr><th class=l>{html.escape(k)}</th><td class=l>{html.escape(v)}</td></tr>"
                               for k, v in items) + "</table>"


def _summary_html(run: EvalRun) -> str:
    head = ("<tr><th class=l>suite</th><th class=l>metric</th><th class=l>group</th><th>mean</th>"
            "<th>95% CI</th><th>items</th><th>samples</th><th>missing</th><th>pass@1</th><th>pass@k</th></tr>")
    body = []
    for s in summarize(run.rows):
        group = " ".join(f"{k}={v}" for k, v in s["labels"].items())
        pk = f"{s['pass@' + str(s['k'])]:.3f} (k={s['k']})" if "k" in s else ""
        p1 = f"{s['pass@1']:.3f}" if "pass@1" in s else ""
        body.append(f"<tr><td class=l>{s['suite']}</td><td class=l>{s['metric']}</td><td class=l>"
                    f"{html.escape(group)}</td><td>{s['mean']:.4g}</td><td>[{s['lo']:.4g}, {s['hi']:.4g}]</td>"
                    f"<td>{s['items']}</td><td>{s['samples']}</td><td>{s['missing']}</td><td>{p1}</td><td>{pk}</td></tr>")
    spread = harness_spread([r for r in run.rows if r["suite"] == "harness"])
    out = "<table class=summary>" + head + "".join(body) + "</table>"
    if spread:
        out += ("<h3>harness spread</h3><table class=spread><tr><th class=l>metric</th><th class=l>group</th>"
                "<th class=l>mean per harness seed</th><th>mean</th><th>spread (std)</th></tr>")
        for s in spread:
            per = ", ".join(f"{h}: {m:.3f}" for h, m in s["by_harness"].items())
            group = " ".join(f"{k}={v}" for k, v in s["labels"].items())
            out += (f"<tr><td class=l>{s['metric']}</td><td class=l>{html.escape(group)}</td><td class=l>{per}</td>"
                    f"<td>{s['mean']:.3f}</td><td>{s['spread']:.3f}</td></tr>")
        out += "</table>"
    return out


def write_report(runs: list[EvalRun], out: Path) -> Path:
    """The page ``out`` (an .html path) and its figures ``<stem>-<figure>.png`` beside it."""
    out.parent.mkdir(parents=True, exist_ok=True)
    figs = _figures(runs)
    parts = [f"<!doctype html><html><head><meta charset=utf-8><title>k3 eval report</title><style>{CSS}</style>"
             "</head><body><h1>k3 eval report</h1><p>Every score below is a function of its conditions; "
             "each run's are listed with it.</p>"]
    for run in runs:
        parts.append(f"<h2>{html.escape(run.name)}</h2>{_conditions_html(run)}{_summary_html(run)}")
    if figs:
        parts.append("<h2>figures</h2>")
    for name, png in figs.items():
        (out.parent / f"{out.stem}-{name}.png").write_bytes(png)
        parts.append(f"<figure><img id=fig-{name} alt='{name}' src='data:image/png;base64,"
                     f"{base64.b64encode(png).decode()}'><figcaption>{name}</figcaption></figure>")
    parts.append("</body></html>")
    out.write_text("".join(parts), encoding="utf-8")
    return out
