"""``k3 task validate DIR | run DIR | suite DIR | replay TRAJ`` (SPEC §7.2, §7.5).

- ``validate DIR``: DIR is one task or a folder of tasks; each is parsed (unknown keys refused),
  with its solution and hack transcripts; prints one line per task, exit 1 if any is invalid.
- ``run DIR --provider scripted|openai|local``: one episode. ``scripted`` replays ``--transcript``
  (default DIR/solution/solve.json); ``openai`` needs ``--base-url`` and ``--model`` (key from
  ``--api-key-env``); ``local`` needs ``--ckpt``. ``--seed`` draws the harness randomization;
  ``--backend`` picks the sandbox backend (namespace by default, or vm; local is refused);
  ``--yolo`` approves every ``ask``; ``--ask`` asks on the terminal (without either, an ``ask`` is denied). Writes the trajectory to ``--out`` (default
  trajectories/ID-TIMESTAMP.jsonl) and prints the turns (reasoning only with ``--show-reasoning``).
- ``suite DIR --workers N [--ray]``: every task; with ``scripted``, the solution and every hack,
  each checked against its ``expect_reward``; exit 1 on any mismatch.
- ``replay TRAJ``: re-runs the episode and compares tool results and verdicts; exit 1 on a mismatch.
- ``gen FAMILY --seeds A:B --out DIR``: writes the family's tasks DIR/<family>-<seed>/ for seeds
  A..B-1 (``k3.tasks.families``); an existing non-empty task directory is refused unless
  ``--overwrite`` (which replaces only generated tasks).
- ``synth FAMILY --seeds A:B [--effort E ...|all] [--out FILE.jsonl] [--tasks-dir DIR]``: runs the
  family's scripted solver on each task and effort through the real harness and sandbox and writes
  one SFT row per passing episode (``k3.rl.synth``); failures are listed with their reasons and
  make the exit code 1.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from k3.errors import ConfigError, K3Error

__all__ = ["task_main"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="k3 task", description="Autonomous Execution Tasks")
    sub = p.add_subparsers(dest="cmd", required=True)
    v = sub.add_parser("validate", help="check task directories")
    v.add_argument("dir")
    for name in ("run", "suite"):
        r = sub.add_parser(name, help="run one task" if name == "run" else "run every task in a folder")
        r.add_argument("dir")
        r.add_argument("--provider", choices=["scripted", "openai", "local"], default="scripted")
        r.add_argument("--backend", default="namespace", help="sandbox backend (namespace | vm)")
        r.add_argument("--seed", type=int, default=None, help="harness randomization seed (default: canonical)")
        r.add_argument("--base-url", default=None, help="openai: e.g. http://127.0.0.1:8000/v1")
        r.add_argument("--model", default=None, help="openai: the model name")
        r.add_argument("--api-key-env", default=None, help="openai: environment variable holding the key")
        r.add_argument("--ckpt", default=None, help="local: the checkpoint directory")
        r.add_argument("--yolo", action="store_true", help="approve every 'ask' (isolating sandboxes only)")
        r.add_argument("--out", default=None, help="trajectory file (run) or folder (suite)")
        r.add_argument("--max-tokens", type=int, default=1024, help="completion tokens per model call")
        r.add_argument("--temperature", type=float, default=0.0)
        r.add_argument("--effort", choices=["low", "high", "max"], default=None, help="reasoning effort")
        if name == "run":
            r.add_argument("--ask", action="store_true",
                           help="answer each policy 'ask' on the terminal (default: an 'ask' is denied)")
            r.add_argument("--transcript", default=None, help="scripted: the transcript (default: the solution)")
            r.add_argument("--show-reasoning", action="store_true")
        else:
            r.add_argument("--workers", type=int, default=1)
            r.add_argument("--ray", action="store_true", help="run the rollouts as Ray tasks")
            r.add_argument("--json", action="store_true", help="print one JSON object per rollout")
    g = sub.add_parser("gen", help="write task directories of a task family")
    g.add_argument("family")
    g.add_argument("--seeds", required=True, help="A:B = seeds A..B-1 (held out from 1000000 on), or one seed N")
    g.add_argument("--out", required=True, help="folder for the task directories")
    g.add_argument("--overwrite", action="store_true", help="replace existing generated tasks")
    sy = sub.add_parser("synth", help="SFT rows from a task family's scripted solver in real sandboxes")
    sy.add_argument("family")
    sy.add_argument("--seeds", required=True, help="A:B = seeds A..B-1, or one seed N")
    sy.add_argument("--effort", action="append", default=None,
                    help="low | high | max | all (repeatable; default all)")
    sy.add_argument("--out", default=None, help="the JSONL file (default sft/FAMILY-A-B.jsonl)")
    sy.add_argument("--tasks-dir", default=None, help="keep the generated tasks here (default: a temporary folder)")
    sy.add_argument("--backend", default="namespace", help="sandbox backend (namespace; local is refused)")
    sy.add_argument("--workers", type=int, default=1)
    sy.add_argument("--overwrite", action="store_true", help="replace an existing --out file")
    sy.add_argument("--per-turn", type=int, default=None, metavar="M",
                    help="one row per M-th turn of each episode, as compacted at --context-tokens "
                         "(only that turn trained)")
    sy.add_argument("--context-tokens", type=int, default=None,
                    help="the harness's context limit for --per-turn episodes (its compaction on)")
    sy.add_argument("--harness-seeds", default=None, metavar="A:B",
                    help="randomized harnesses (seeds A..B-1, in turn) for --per-turn episodes")
    rp = sub.add_parser("replay", help="re-run a trajectory and compare")
    rp.add_argument("trajectory")
    rp.add_argument("--backend", default=None)
    rp.add_argument("--task", default=None, help="the task directory (default: the recorded path)")
    return p


def _provider_spec(args, transcript: str | None) -> dict:
    if args.provider == "scripted":
        return {"kind": "scripted", "transcript": transcript}
    if args.provider == "openai":
        if not args.base_url or not args.model:
            raise ConfigError("--provider openai needs --base-url and --model")
        return {"kind": "openai", "base_url": args.base_url, "model": args.model, "api_key_env": args.api_key_env}
    if not args.ckpt:
        raise ConfigError("--provider local needs --ckpt")
    return {"kind": "local", "ckpt": args.ckpt}


def _terminal_approver(req) -> bool:
    """The approval callback of ``--ask``: shows the call and the reason, reads y/N from stdin."""
    print(f"policy asks: {req.tool} {json.dumps(req.arguments, ensure_ascii=False)[:300]}\n  because {req.reason}")
    try:
        return input("  allow? [y/N] ").strip().lower() in ("y", "yes")
    except EOFError:
        return False


def _sampling(args) -> dict:
    if args.max_tokens < 1:
        raise ConfigError(f"--max-tokens must be >= 1, got {args.max_tokens}")
    return {"max_tokens": args.max_tokens, "temperature": args.temperature, "effort": args.effort}


def _check_flags(args) -> None:
    if args.provider != "openai" and (args.base_url or args.model or args.api_key_env):
        raise ConfigError("--base-url/--model/--api-key-env are for --provider openai")
    if args.provider != "local" and args.ckpt:
        raise ConfigError("--ckpt is for --provider local")


def cmd_validate(args) -> int:
    from k3.tasks.format import find_tasks, validate_task

    bad = 0
    for d in find_tasks(args.dir):
        try:
            t = validate_task(d)
            print(f"ok      {t.id}: {t.kind}, submit {t.submit}, {len(t.hacks)} hack(s)")
        except K3Error as e:
            bad += 1
            print(f"INVALID {d.name}: {e}")
    return 1 if bad else 0


def cmd_run(args) -> int:
    from k3.rl.rollout import make_provider, run_episode
    from k3.tasks.format import load_task
    from k3.rl.trajectory import TrajectoryWriter

    _check_flags(args)
    task = load_task(args.dir, transcripts=False)
    if args.provider != "scripted" and args.transcript:
        raise ConfigError("--transcript is for --provider scripted")
    transcript = args.transcript or str(task.root / "solution" / "solve.json")
    from k3.tasks.verify import Sandboxes
    sandboxes = Sandboxes(args.backend)  # refuses a backend before anything is written
    provider = make_provider(_provider_spec(args, transcript))
    if args.ask and args.yolo:
        raise ConfigError("--ask and --yolo exclude each other")
    out = Path(args.out or f"trajectories/{task.id}-{time.strftime('%Y%m%d-%H%M%S')}.jsonl")
    writer = TrajectoryWriter(out)
    try:
        s = run_episode(task.root, provider, writer, sandboxes=sandboxes, harness=args.seed, yolo=args.yolo,
                        approve=_terminal_approver if args.ask else None, seed=args.seed, **_sampling(args))
    finally:
        writer.close()
        provider.close()
    from k3.agent.turns import AgentTurn, ToolCall

    for r in writer.records:
        if r["type"] == "turn":
            t = AgentTurn(r["visible"], r["reasoning"], [ToolCall(c["id"], c["name"], c["arguments"])
                                                         for c in r["tool_calls"]], [], r["provider"])
            print(f"[turn {r['index']}] {t.show(reasoning=args.show_reasoning)}")
        elif r["type"] == "policy" and not r["allowed"]:
            print(f"  policy {r['action']} ({r['rule']}): {r['reason']}")
    print(f"{task.id}: score {s['score']:.3f} ({s['status']}; {s['steps']} tool calls, "
          f"{s['submissions']} submission(s)); trajectory {out}")
    return 0


def _suite_jobs(args, out_dir: Path | None) -> list[dict]:
    from k3.tasks.format import find_tasks, load_task, validate_task

    jobs = []
    for d in find_tasks(args.dir):
        if args.provider == "scripted":
            t = validate_task(d)
            runs = [("solution", t.solution)] + [(f"hack:{h.path.stem}", h) for h in t.hacks]
            for label, tr in runs:
                jobs.append({"task": str(t.root), "provider": {"kind": "scripted", "transcript": str(tr.path)},
                             "label": label, "expect": tr.expect_reward})
        else:
            t = load_task(d, transcripts=False)
            jobs.append({"task": str(t.root), "provider": _provider_spec(args, None), "label": "run",
                         "expect": None})
    for j in jobs:
        j.update(seed=args.seed, backend=args.backend, yolo=args.yolo, sampling=_sampling(args))
        if out_dir is not None:
            j["out"] = str(out_dir / f"{Path(j['task']).name}.{j['label'].replace(':', '-')}.jsonl")
    return jobs


def cmd_suite(args) -> int:
    from k3.rl.rollout import run_jobs

    _check_flags(args)
    out_dir = Path(args.out) if args.out else None
    jobs = _suite_jobs(args, out_dir)
    from k3.tasks.verify import Sandboxes
    Sandboxes(args.backend).close()  # build the base image once, before the workers race for it
    t0 = time.monotonic()
    results = run_jobs(jobs, workers=args.workers, use_ray=args.ray)
    wall = time.monotonic() - t0
    bad = 0
    for r in results:
        ok = r["expect"] is None or (abs(r["score"] - r["expect"]) < 1e-9 and r["status"] != "error")
        bad += not ok
        if args.json:
            print(json.dumps({**r, "ok": ok}))
        else:
            print(f"{'ok  ' if ok else 'FAIL'} {r['task']:28} {r['label']:28} score {r['score']:.3f}"
                  + (f" (expected {r['expect']:.3f})" if r["expect"] is not None else "")
                  + f" {r['status']}" + (f": {r.get('detail')}" if r.get("detail") else ""))
    print(f"suite: {len(results) - bad}/{len(results)} as expected, wall {wall:.1f} s, workers {args.workers}"
          + (" (ray)" if args.ray else ""))
    return 1 if bad else 0


def cmd_replay(args) -> int:
    from k3.rl.rollout import replay

    rep = replay(args.trajectory, backend=args.backend, task_dir=args.task)
    for m in rep.mismatches:
        print(f"MISMATCH {m}")
    counts = ", ".join(f"{n} {k}" for k, n in rep.compared.items())
    print(f"replay: {'reproduced' if rep.ok else 'DIFFERS'} ({counts}); score {rep.score} "
          f"(recorded {rep.recorded_score})")
    return 0 if rep.ok else 1


def cmd_gen(args) -> int:
    from k3.rl.synth import parse_seeds
    from k3.tasks.families import get_family, split_of

    fam, seeds = get_family(args.family), parse_seeds(args.seeds)
    splits = {"train": 0, "heldout": 0}
    for seed in seeds:  # every target checked before anything is written
        fam.target(seed, args.out, overwrite=args.overwrite)
    for seed in seeds:
        fam.generate(seed, args.out, overwrite=args.overwrite)
        splits[split_of(seed)] += 1
    print(f"{fam.name}: wrote {len(seeds)} task(s) to {args.out} "
          f"({splits['train']} train, {splits['heldout']} held out)")
    return 0


def cmd_synth(args) -> int:
    from k3.rl.synth import parse_efforts, parse_seeds, synthesize
    from k3.tasks.families import get_family

    fam, seeds, efforts = get_family(args.family), parse_seeds(args.seeds), parse_efforts(args.effort)
    if args.workers < 1:
        raise ConfigError(f"--workers must be >= 1, got {args.workers}")
    out = args.out or f"sft/{fam.name}-{seeds.start}-{seeds.stop}.jsonl"
    harness = None if args.harness_seeds is None else parse_seeds(args.harness_seeds, "--harness-seeds")
    rep = synthesize(fam.name, seeds, efforts, out, tasks_dir=args.tasks_dir, backend=args.backend,
                     workers=args.workers, overwrite=args.overwrite, per_turn=args.per_turn,
                     context_tokens=args.context_tokens, harness_seeds=harness, log=print)
    print(f"synth: {rep.rows} row(s) from {rep.episodes} episode(s) -> {rep.out}; {len(rep.failed)} failed")
    return 1 if rep.failed else 0


def task_main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    return {"validate": cmd_validate, "run": cmd_run, "suite": cmd_suite, "replay": cmd_replay, "gen": cmd_gen,
            "synth": cmd_synth}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(task_main())
