"""Tables of evaluation rows: per-group summaries, the harness spread, and run comparison.

``summarize(rows)`` groups rows by (suite, metric, labels) and gives the mean over items of each
item's mean (rows whose value is null, an episode that failed before scoring, are counted as
``missing`` and left out), its bootstrap interval (``k3.rl.eval_stats``), and for pass/fail metrics (``score``
counts as passed at 1.0, ``correct`` at 1) pass@1 and pass@k with k the samples per item.

``compare(runs, ignore)`` matches rows of several runs by (suite, item, sample, metric, and the
row's order among rows sharing those) and checks
that every condition except the model is equal for each matched row; a differing condition (or a
different set of items, named ``items``) is refused with a ConfigError naming the field and the
values, unless it is in ``ignore``; then the table states each ignored difference.
"""

from __future__ import annotations

import json
import statistics
from collections import defaultdict

from k3.errors import ConfigError
from k3.rl.eval_stats import mean_and_ci, pass_at_k

__all__ = ["summarize", "harness_spread", "compare", "format_summary", "condition_fields", "format_compare",
           "PASS_METRICS"]

PASS_METRICS = {"score": 1.0, "correct": 1.0}


def _labels_key(labels: dict) -> tuple:
    """A sortable key of a row's labels: numbers in numeric order (T=64 before T=512), null first."""
    def order(v):
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            return (1, float(v), "")
        return (0, 0.0, "") if v is None else (2, 0.0, json.dumps(v))
    return tuple(sorted((k, order(v)) for k, v in labels.items()))


def summarize(rows: list[dict]) -> list[dict]:
    groups: dict[tuple, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    labels_of: dict[tuple, dict] = {}
    missing: dict[tuple, int] = defaultdict(int)
    for r in rows:
        key = (r["suite"], r["metric"], _labels_key(r["labels"]))
        labels_of[key] = r["labels"]
        if r["value"] is None:
            missing[key] += 1
            continue
        groups[key][r["item"]].append(float(r["value"]))
    out = []
    for key in sorted(labels_of):
        suite, metric, _ = key
        by_item = groups.get(key)
        if not by_item:  # every row of the group failed: no mean, only the count
            out.append({"suite": suite, "metric": metric, "labels": labels_of[key], "mean": float("nan"),
                        "lo": float("nan"), "hi": float("nan"), "items": 0, "samples": 0, "missing": missing[key]})
            continue
        s = {"suite": suite, "metric": metric, "labels": labels_of[key], **mean_and_ci(list(by_item.values())),
             "missing": missing[key]}
        if metric in PASS_METRICS:
            k = min(len(v) for v in by_item.values())
            passed = [(len(v), sum(x >= PASS_METRICS[metric] for x in v)) for v in by_item.values()]
            s["pass@1"] = statistics.fmean(pass_at_k(n, c, 1) for n, c in passed)
            s["k"] = k
            s[f"pass@{k}"] = statistics.fmean(pass_at_k(n, c, k) for n, c in passed)
        out.append(s)
    return out


def harness_spread(rows: list[dict]) -> list[dict]:
    """Per (suite, metric, labels other than ``harness``): the mean score under each harness seed
    and their spread (population std over the seeds); a model that learned one exam room varies."""
    per: dict[tuple, dict] = defaultdict(lambda: defaultdict(list))
    labels_of: dict[tuple, dict] = {}
    for r in rows:
        if r["value"] is None or "harness" not in r["labels"]:
            continue
        rest = {k: v for k, v in r["labels"].items() if k != "harness"}
        key = (r["suite"], r["metric"], _labels_key(rest))
        labels_of[key] = rest
        per[key][json.dumps(r["labels"]["harness"])].append(float(r["value"]))
    out = []
    for key in sorted(per):
        means = {h: statistics.fmean(v) for h, v in per[key].items()}
        vals = list(means.values())
        out.append({"suite": key[0], "metric": key[1], "labels": labels_of[key],
                    "by_harness": {json.loads(h): m for h, m in sorted(means.items())},
                    "mean": statistics.fmean(vals), "spread": statistics.pstdev(vals) if len(vals) > 1 else 0.0})
    return out


def condition_fields(cond: dict) -> dict:
    """A row's conditions as flat fields for comparison: the model left out, ``setup`` and
    ``seeds`` split into their keys (``setup.threads``), everything else whole."""
    out = {}
    for k, v in cond.items():
        if k == "model":
            continue
        if k in ("setup", "seeds") and isinstance(v, dict):
            for kk, vv in v.items():
                out[f"{k}.{kk}"] = vv
        else:
            out[k] = v
    return out


def _keyed(rows: list[dict]) -> dict[tuple, dict]:
    """Rows by (suite, item, sample, metric, n): n counts earlier rows with the same four, so the
    rows of one task under several efforts or harness seeds pair up in run order (their conditions
    are then compared, not assumed); the harness suite pairs with the agent suite."""
    seen: dict[tuple, int] = {}
    out = {}
    for r in rows:
        k = ("agent" if r["suite"] == "harness" else r["suite"], r["item"], r["sample"], r["metric"])
        n = seen[k] = seen.get(k, -1) + 1
        out[(*k, n)] = r
    return out


def _short(v) -> str:
    s = json.dumps(v, sort_keys=True)
    return s if len(s) <= 60 else s[:57] + "..."


def compare(runs: list, ignore: set[str] | frozenset = frozenset()) -> dict:
    """``{"differences": {field: [value per run]}, "ignored": [...], "table": [...]}``; a ConfigError
    when a difference is not in ``ignore`` (see the module doc)."""
    if len(runs) < 2:
        raise ConfigError("k3 eval compare needs at least two runs")
    keyed = [_keyed(run.rows) for run in runs]
    common = set(keyed[0]).intersection(*keyed[1:])
    if not common:
        raise ConfigError("the runs share no (suite, item, sample, metric): nothing to compare")
    diffs: dict[str, list] = {}
    if any(set(k) != common for k in keyed):
        diffs["items"] = [len(k) for k in keyed]
    for key in sorted(common):
        fields = [condition_fields(k[key]["conditions"]) for k in keyed]
        for f in sorted(set().union(*fields)):
            vals = [fl.get(f, "<absent>") for fl in fields]
            if any(json.dumps(v, sort_keys=True) != json.dumps(vals[0], sort_keys=True) for v in vals[1:]):
                diffs.setdefault(f, vals)
    refused = [f for f in diffs if f not in ignore]
    if refused:
        f = refused[0]
        vals = ", ".join(f"{run.name}: {_short(v)}" for run, v in zip(runs, diffs[f]))
        more = f" (and {len(refused) - 1} more: {', '.join(refused[1:])})" if len(refused) > 1 else ""
        what = "rows per run" if f == "items" else "values"
        raise ConfigError(f"the runs differ in {f} ({what} {vals}){more}; rerun under the same conditions "
                          f"or name it with --ignore {f}")
    sums = [{(m["suite"], m["metric"], _labels_key(m["labels"])): m
             for m in summarize([k[key] for key in sorted(common)])} for k in keyed]
    table = []
    for g in sorted(set().union(*sums)):
        first = next(s[g] for s in sums if g in s)
        table.append({"suite": g[0], "metric": g[1], "labels": first["labels"],
                      "runs": [None if g not in s else {x: s[g][x] for x in ("mean", "lo", "hi", "items", "samples",
                                                                              "missing", "pass@1") if x in s[g]}
                               for s in sums]})
    return {"runs": [run.name for run in runs], "models": [run.rows[0]["conditions"]["model"] for run in runs],
            "differences": {f: diffs[f] for f in diffs}, "ignored": sorted(diffs), "table": table}


def _labels_text(labels: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in labels.items()) or "-"


def format_summary(summary: list[dict]) -> str:
    lines = [f"{'suite':8} {'metric':22} {'group':36} {'mean':>10} {'95% CI':>21} {'items':>5} {'missing':>7} {'pass@1':>7} {'pass@k':>10}"]
    for s in summary:
        pk = f"{s['pass@' + str(s['k'])]:.3f}@{s['k']}" if "k" in s else ""
        p1 = f"{s['pass@1']:.3f}" if "pass@1" in s else ""
        lines.append(f"{s['suite']:8} {s['metric']:22} {_labels_text(s['labels'])[:36]:36} {s['mean']:10.4g} "
                     f"[{s['lo']:9.4g}, {s['hi']:9.4g}] {s['items']:5d} {s['missing']:7d} {p1:>7} {pk:>10}")
    return "\n".join(lines)


def format_compare(result: dict) -> str:
    names = result["runs"]
    head = f"{'suite':8} {'metric':14} {'group':30} " + " ".join(f"{n[:24]:>24}" for n in names)
    lines = [head]
    for e in result["table"]:
        cells = ["-" if r is None else f"{r['mean']:8.4g} [{r['lo']:.3g},{r['hi']:.3g}]" for r in e["runs"]]
        lines.append(f"{e['suite']:8} {e['metric'][:14]:14} {_labels_text(e['labels'])[:30]:30} "
                     + " ".join(f"{c:>24}" for c in cells))
    for f in result["ignored"]:
        vals = ", ".join(f"{n}: {_short(v)}" for n, v in zip(names, result["differences"][f]))
        lines.append(f"ignored difference: {f} ({vals})")
    return "\n".join(lines)
