"""``k3 eval``: every score carries its conditions (SPEC §11).

    k3 eval SUITE (--model CKPT | --base-url URL --served-model NAME) [--effort max] [--temperature 1.0]
                  [--harness-seeds ...] [--samples k] [--out DIR] ...
    k3 eval compare RUN RUN ... [--ignore FIELD,...]
    k3 eval report RUN ... [--out PAGE.html]

Suites (``k3.rl.eval_suites``): ``bpb``, ``agent``, ``harness``, ``accept``, ``retrieve``, ``sustain``. The
defaults are the seeds' reporting conditions, maximum effort and temperature 1.0, and every table
prints the conditions it was measured under. ``OUT`` gets ``rows.jsonl`` (one row per value,
conditions included), ``run.json`` and, for agent suites, the trajectories.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

from k3.errors import ConfigError

__all__ = ["eval_main"]

SUITES = ("bpb", "agent", "harness", "accept", "retrieve", "sustain")
EFFORTS = ("low", "high", "max")
REPO = Path(__file__).resolve().parents[3]
DEFAULT_HARNESS_SEEDS = "0,1,2,3,4"


def _ints(text: str, flag: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"{flag} takes comma-separated integers, got {text!r}") from None
    if not out:
        raise ConfigError(f"{flag} is empty")
    return out


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="k3 eval", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="suite", required=True)
    for name in SUITES:
        sp = sub.add_parser(name, help=f"run the {name} suite")
        sp.add_argument("--model", help="checkpoint: a run, checkpoint folder or model directory")
        sp.add_argument("--out", help="output folder (default runs/eval/SUITE-DATE-TIME)")
        sp.add_argument("--overwrite", action="store_true", help="replace the rows of an earlier run in --out")
        if name in ("agent", "harness", "sustain"):
            sp.add_argument("--base-url", help="an OpenAI-compatible endpoint instead of --model")
            sp.add_argument("--served-model", help="the model name at --base-url")
            sp.add_argument("--api-key-env", help="environment variable holding the endpoint's API key")
        if name == "sustain":
            sp.add_argument("--reference", action="store_true",
                            help="run the workload's reference solution instead of a model (the control)")
            sp.add_argument("--steps", type=int, default=100, help="chained steps (about 2 tool calls each)")
            sp.add_argument("--seeds", default="0", help="workload seeds, comma list (one episode pair each)")
            sp.add_argument("--context-tokens", type=int, default=4096,
                            help="the harness's context limit with compaction on (off: never compacted)")
            sp.add_argument("--effort", default="max", help="low | high | max (default max)")
            sp.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (default 1.0)")
            sp.add_argument("--max-tokens", type=int, default=256, help="tokens per assistant turn")
            sp.add_argument("--workers", type=int, default=1)
            sp.add_argument("--ray", action="store_true", help="run the episodes as Ray tasks")
            sp.add_argument("--backend", default="namespace", help="sandbox backend (default namespace)")
        if name in ("agent", "harness"):
            sp.add_argument("--tasks", action="append",
                            help="task dir, folder of tasks, or FAMILY:A:B (held-out seeds); repeatable "
                                 "(default: the starter tasks)")
            sp.add_argument("--effort", default="max", help="low | high | max, or a comma list (default max)")
            sp.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (default 1.0)")
            sp.add_argument("--harness-seeds", default=DEFAULT_HARNESS_SEEDS if name == "harness" else "canonical",
                            help="comma list of harness randomization seeds, or 'canonical' (default: "
                                 + ("0,1,2,3,4" if name == "harness" else "canonical") + ")")
            sp.add_argument("--samples", type=int, default=1, help="samples per task (pass@k); default 1")
            sp.add_argument("--workers", type=int, default=1)
            sp.add_argument("--ray", action="store_true", help="run the episodes as Ray tasks")
            sp.add_argument("--max-tokens", type=int, default=1024, help="tokens per assistant turn")
            sp.add_argument("--backend", default="namespace", help="sandbox backend (default namespace)")
            sp.add_argument("--no-hacks", action="store_true", help="skip the hack-suite column")
        if name == "bpb":
            sp.add_argument("--data", help="local text (file or folder; default: the default corpus)")
            sp.add_argument("--val-percent", type=int, default=2)
            sp.add_argument("--seq-len", type=int, help="window length (default: the run's longest, else 1024)")
            sp.add_argument("--batch-size", type=int, default=4)
            sp.add_argument("--max-batches", type=int, default=0, help="0: the whole validation split")
        if name in ("accept", "retrieve"):
            sp.add_argument("--lengths", default="1024,2048,4096,8192,16384,32768,65536",
                            help="context lengths T in tokens, comma list")
        if name == "accept":
            sp.add_argument("--decode-tokens", type=int, default=16)
        if name == "retrieve":
            sp.add_argument("--depths", default="0,0.5,1", help="relative positions of the fact, comma list")
            sp.add_argument("--kinds", default="needle,multikey")
            sp.add_argument("--seeds", type=int, default=3, help="items per (kind, length, depth)")
            sp.add_argument("--n-keys", type=int, default=8, help="facts in a multikey haystack")
    cp = sub.add_parser("compare", help="put runs side by side; refuses differing conditions unless --ignore")
    cp.add_argument("runs", nargs="+")
    cp.add_argument("--ignore", default="", help="comma list of condition fields allowed to differ (named in the table)")
    cp.add_argument("--json", action="store_true")
    rp = sub.add_parser("report", help="one self-contained HTML page and PNG figures from runs")
    rp.add_argument("runs", nargs="+")
    rp.add_argument("--out", help="page path (default: RUN/report.html of the first run)")
    return p


def _out_dir(args) -> Path:
    out = Path(args.out) if args.out else Path("runs") / "eval" / f"{args.suite}-{time.strftime('%Y%m%d-%H%M%S')}"
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out}: not a directory")
    if (out / "rows.jsonl").exists():
        if not args.overwrite:
            raise ConfigError(f"--out {out} already holds evaluation rows; choose another folder or --overwrite")
        (out / "rows.jsonl").unlink()
        shutil.rmtree(out / "trajectories", ignore_errors=True)
    return out


def _model(args) -> tuple[dict | None, dict]:
    """(provider spec for agent suites, the model condition)."""
    from k3.rl.eval_rows import endpoint_condition, model_condition

    if getattr(args, "reference", False):
        if args.model or args.base_url:
            raise ConfigError("--reference runs the workload's own solution: give no --model / --base-url")
        return None, {"kind": "scripted", "name": "reference solution"}
    if not hasattr(args, "base_url"):
        if not args.model:
            raise ConfigError("--model CKPT is required")
        return None, model_condition(args.model)
    url = args.base_url
    if bool(args.model) == bool(url):
        raise ConfigError("give exactly one of --model CKPT and --base-url URL")
    if url:
        if not args.served_model:
            raise ConfigError("--base-url needs --served-model NAME")
        spec = {"kind": "openai", "base_url": url, "model": args.served_model}
        if args.api_key_env:
            spec["api_key_env"] = args.api_key_env
        return spec, endpoint_condition(url, args.served_model)
    return {"kind": "local", "ckpt": str(Path(args.model).resolve())}, model_condition(args.model)


def _run_suite(args) -> int:
    from k3.rl import eval_suites as S
    from k3.rl.grpo import resolve_tasks
    from k3.rl.eval_tables import format_summary, harness_spread, summarize

    provider, model = _model(args)
    out = _out_dir(args)
    started = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    defaults: dict = {}
    if args.suite in ("agent", "harness"):
        efforts = [e.strip() for e in args.effort.split(",") if e.strip()]
        bad = [e for e in efforts if e not in EFFORTS]
        if bad or not efforts:
            raise ConfigError(f"--effort must be low, high or max (or a comma list), got {args.effort!r}")
        if args.temperature < 0:
            raise ConfigError(f"--temperature must be >= 0, got {args.temperature}")
        if args.samples < 1 or args.workers < 1 or args.max_tokens < 1:
            raise ConfigError("--samples, --workers and --max-tokens must be >= 1")
        seeds = ([None] if args.harness_seeds == "canonical"
                 else _ints(args.harness_seeds, "--harness-seeds"))
        if not args.tasks and not (REPO / "tasks").is_dir():
            raise ConfigError(f"--tasks is required (the starter tasks, {REPO / 'tasks'}, are not here)")
        specs = args.tasks or [str(REPO / "tasks")]
        tasks = resolve_tasks(specs, out, heldout=True)
        defaults = {"effort": efforts, "temperature": args.temperature, "harness_seeds": seeds,
                    "samples": args.samples, "tasks": specs}
        _print_conditions(model, defaults)
        rows = S.run_agent(provider, model, tasks, out, efforts=efforts, temperature=args.temperature,
                           samples=args.samples, harness_seeds=seeds, workers=args.workers,
                           max_tokens=args.max_tokens, backend=args.backend, hacks=not args.no_hacks,
                           suite=args.suite, use_ray=args.ray)
    elif args.suite == "sustain":
        if args.effort not in EFFORTS:
            raise ConfigError(f"--effort must be low, high or max, got {args.effort!r}")
        if args.temperature < 0 or args.workers < 1 or args.max_tokens < 1:
            raise ConfigError("--temperature must be >= 0, --workers and --max-tokens >= 1")
        seeds = _ints(args.seeds, "--seeds")
        defaults = {"steps": args.steps, "seeds": seeds, "context_tokens": args.context_tokens,
                    "effort": args.effort, "temperature": args.temperature}
        _print_conditions(model, defaults)
        rows = S.run_sustain(provider, model, out, steps=args.steps, seeds=seeds, context_tokens=args.context_tokens,
                             effort=args.effort, temperature=args.temperature, max_tokens=args.max_tokens,
                             backend=args.backend, workers=args.workers, use_ray=args.ray)
    elif args.suite == "bpb":
        for flag in ("batch_size",):
            if getattr(args, flag) < 1:
                raise ConfigError(f"--{flag.replace('_', '-')} must be >= 1")
        if not 0 <= args.val_percent <= 100:
            raise ConfigError(f"--val-percent must be in 0..100, got {args.val_percent}")
        defaults = {"data": args.data or "default corpus", "seq_len": args.seq_len or "the run's longest"}
        _print_conditions(model, defaults)
        rows = S.run_bpb(args.model, model, out, args.data, args.val_percent, args.seq_len, args.batch_size,
                         args.max_batches)
    elif args.suite == "accept":
        lengths = _ints(args.lengths, "--lengths")
        defaults = {"lengths": lengths, "decode_tokens": args.decode_tokens}
        _print_conditions(model, defaults)
        rows = S.run_accept(args.model, model, out, lengths, args.decode_tokens)
    else:
        lengths = _ints(args.lengths, "--lengths")
        try:
            depths = [float(x) for x in args.depths.split(",")]
        except ValueError:
            raise ConfigError(f"--depths takes comma-separated numbers in [0, 1], got {args.depths!r}") from None
        if any(not 0 <= d <= 1 for d in depths):
            raise ConfigError(f"--depths must lie in [0, 1], got {args.depths!r}")
        kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
        if not kinds or any(k not in ("needle", "multikey") for k in kinds):
            raise ConfigError(f"--kinds takes needle and/or multikey, got {args.kinds!r}")
        defaults = {"lengths": lengths, "depths": depths, "kinds": kinds, "seeds": args.seeds}
        _print_conditions(model, defaults)
        rows = S.run_retrieve(args.model, model, out, lengths, depths, kinds, args.seeds, args.n_keys)
    (out / "run.json").write_text(json.dumps({"suite": args.suite, "argv": sys.argv, "model": model,
                                              "conditions": defaults, "started": started,
                                              "finished": time.strftime("%Y-%m-%dT%H:%M:%S%z")}, indent=2) + "\n")
    print(format_summary(summarize(rows)))
    spread = harness_spread([r for r in rows if r["suite"] == "harness"])
    for s in spread:
        print(f"harness spread {s['metric']} {s['labels']}: mean {s['mean']:.3f}, std over seeds {s['spread']:.3f} "
              f"({', '.join(f'{h}: {m:.3f}' for h, m in s['by_harness'].items())})")
    print(f"rows: {out / 'rows.jsonl'}")
    return 0


def _print_conditions(model: dict, defaults: dict) -> None:
    shown = ", ".join(f"{k} {v}" for k, v in defaults.items())
    print(f"conditions: model {json.dumps(model)}; {shown}")


def _compare(args) -> int:
    from k3.rl.eval_rows import EvalRun
    from k3.rl.eval_tables import compare, format_compare

    runs = [EvalRun.load(p) for p in args.runs]
    res = compare(runs, {f.strip() for f in args.ignore.split(",") if f.strip()})
    print(json.dumps(res) if args.json else format_compare(res))
    return 0


def _report(args) -> int:
    from k3.rl.eval_report import write_report
    from k3.rl.eval_rows import EvalRun

    runs = [EvalRun.load(p) for p in args.runs]
    first = Path(args.runs[0])
    out = Path(args.out) if args.out else (first if first.is_dir() else first.parent) / "report.html"
    print(f"report: {write_report(runs, out)}")
    return 0


def eval_main(argv: list[str] | None = None) -> int:
    from k3.cliutil import guarded

    args = _parser().parse_args(argv)
    action = {"compare": _compare, "report": _report}.get(args.suite, _run_suite)
    return guarded("eval", lambda: action(args))
