"""Rollouts (SPEC §7.5): (task, provider, harness seed) -> trajectory JSONL + a summary.

``run_episode`` is the one episode: agent sandbox from the task (namespace backend unless told),
the harness loop with the task's budgets and policy, submissions collected as data at each
``submit``, then the clean-room verification of the submissions the scoring needs ("last": the
last accepted one; "best": the accepted ones in order until one scores 1.0, the maximum). An episode past its wall-time budget
is scored 0 without verification. A task with ``answer`` (k3.tasks.format): when the episode ends
because the model replied without a tool call, that reply's visible content is written to
/workspace/<answer> in the agent's sandbox and submitted there, as a ``submit`` call would be
(the submission budget applies; the record says ``"source": "answer"``). ``rollout(job)`` is the same from a plain, picklable job dict
(what workers receive); ``run_jobs(jobs, workers, use_ray)`` runs many: in this process for one
worker, a process pool for several, or Ray tasks (``ray.init(num_cpus=workers)`` when Ray is not
already connected; ``RAY_ADDRESS`` reaches a cluster), each running ``rollout`` unchanged.

Job dict: ``{"task": DIR, "provider": {"kind": "scripted", "transcript": FILE} | {"kind": "openai",
"base_url", "model", "api_key_env"?} | {"kind": "local", "ckpt"}, "seed": int|None, "backend":
str, "out": FILE|None, "label": str, "expect": float|None, "yolo": bool, "sampling": {"max_tokens",
"temperature", "effort", "context_tokens"}, "harness": int|None, "threads": int|None}`` (all but
task and provider optional; ``harness``, the randomization seed, defaults to ``seed``, the sampling
seed; ``threads``: the worker's torch thread count, so that its numbers are those of a process at
that count: a model's last bits depend on how its reductions are split over threads).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from k3.agent.harness import Harness
from k3.agent.policy import Policy
from k3.agent.providers import LocalEngine, OpenAICompatible, Scripted
from k3.agent.randomize import HarnessConfig
from k3.agent.tools import ToolBox
from k3.errors import ConfigError, K3Error
from k3.tasks.format import load_task, load_transcript
from k3.rl.trajectory import VERSION, ReplayProvider, ReplayReport, TrajectoryWriter, compare, read_trajectory
from k3.tasks.verify import Sandboxes, agent_sandbox, collect_submission, verify

__all__ = ["run_episode", "rollout", "run_jobs", "worker_pool", "make_provider", "job_provider", "replay"]


def make_provider(spec: dict):
    kind = spec.get("kind")
    if kind == "scripted":
        return Scripted(load_transcript(spec["transcript"]).turns)
    if kind == "openai":
        key = os.environ.get(spec["api_key_env"]) if spec.get("api_key_env") else None
        return OpenAICompatible(spec["base_url"], spec["model"], api_key=key)
    if kind == "local":
        return LocalEngine.from_checkpoint(spec["ckpt"])
    raise ConfigError(f"provider kind must be scripted, openai or local, got {kind!r}")


_KEPT: dict = {}   # this process's provider of a versioned local checkpoint: {"key", "provider"}


def job_provider(spec: dict):
    """(provider, owned) for a job: ``owned`` ones are the job's to close. A local checkpoint with a
    ``version`` (k3 rl: the run and step whose weights were saved there) is kept for the next job
    of the same version in this process, so a worker loads each step's weights once and samples
    its episodes with one engine, as the in-process path does (the engine keeps no state between
    requests: no prefix cache). A new version closes the kept one and loads the weights again."""
    version = spec.get("version") if spec.get("kind") == "local" else None
    if version is None:
        return make_provider(spec), True
    key = (str(spec["ckpt"]), str(version))
    if _KEPT.get("key") != key:
        old = _KEPT.pop("provider", None)
        _KEPT.pop("key", None)
        if old is not None:
            old.close()
        provider = make_provider(spec)
        _KEPT.update(key=key, provider=provider)
    return _KEPT["provider"], False


def run_episode(task_dir, provider, writer: TrajectoryWriter, *, backend: str = "namespace",
                harness: dict | int | None = None, yolo: bool = False, approve=None,
                expect_digest: str | None = None, effort: str | None = None, temperature: float = 0.0,
                max_tokens: int | None = 1024, context_tokens: int = 16384, seed: int | None = None,
                sandboxes: Sandboxes | None = None) -> dict:
    """One episode; writes every record to ``writer`` and returns the summary (see module doc)."""
    t_start = time.monotonic()
    task = load_task(task_dir, transcripts=False)
    digest = task.digest()
    if expect_digest is not None and digest != expect_digest:
        raise K3Error(f"{task.root}: the task changed since the trajectory was recorded (sha256 differs)")
    cfg = HarnessConfig.from_dict(harness) if isinstance(harness, dict) else HarnessConfig.from_seed(harness)
    own = sandboxes is None
    sandboxes = sandboxes or Sandboxes(backend)
    policy = Policy(approve, yolo=yolo, sandboxed=sandboxes.isolating)
    budget = task.budget
    timings: dict = {}
    subs: list = []
    try:
        t0 = time.monotonic()
        sb = agent_sandbox(task, sandboxes)
        timings["agent_sandbox"] = time.monotonic() - t0
        try:
            box = ToolBox(sb)

            def submit(source: str = "submit") -> str:
                t1 = time.monotonic()
                s = collect_submission(sb, task.submit)
                timings["collect"] = timings.get("collect", 0.0) + time.monotonic() - t1
                subs.append(s)
                writer.write("submission", {"accepted": True, "index": len(subs) - 1, "manifest": s.manifest(),
                                            "reason": None, "source": source})
                left = budget.submissions - len(subs)
                return (f"submission {len(subs)} accepted ({len(s.files)} files; {left} left). "
                        "It is graded by the hidden verifier after the episode.")

            h = Harness(provider, box, policy, cfg, budget, task.goal, submit, writer.write,
                        allowed_tools=tuple(task.allowed_tools), context_tokens=context_tokens,
                        temperature=temperature, effort=effort, max_tokens=max_tokens, seed=seed,
                        answer=task.answer)
            writer.write("header", {"version": VERSION, "task": {"id": task.id, "path": str(task.root.resolve()),
                                                                  "sha256": digest},
                                    "backend": sandboxes.backend, "conditions": h.conditions(),
                                    "policy": {"yolo": yolo, "network": False}})
            t0 = time.monotonic()
            res = h.run()
            timings["agent"] = time.monotonic() - t0
            if task.answer is not None:
                _submit_answer(task, res, box, submit, len(subs), writer)
        finally:
            t0 = time.monotonic()
            sb.close()
            timings["agent_close"] = time.monotonic() - t0
        score, verdicts = _score(task, res.status, subs, sandboxes, writer)
    finally:
        if own:
            sandboxes.close()
    timings["verify"] = sum(v.elapsed for v in verdicts)
    timings["verify_parts"] = _sum_parts([v.timings for v in verdicts])
    timings["total"] = time.monotonic() - t_start
    timings = _rounded(timings)
    refused = sum(1 for d in policy.log if d.tool == "submit" and not d.allowed)
    writer.write("end", {"status": res.status, "detail": res.detail, "score": score, "steps": res.steps,
                         "tokens": res.tokens, "submissions": len(subs), "refused_submissions": refused,
                         "timings": timings})
    return {"task": task.id, "score": score, "status": res.status, "steps": res.steps, "tokens": res.tokens,
            "submissions": len(subs), "refused_submissions": refused, "timings": timings,
            "verdicts": [v.as_dict() for v in verdicts]}


def _submit_answer(task, res, box: ToolBox, submit, used: int, writer: TrajectoryWriter) -> None:
    """The final reply as the submission of ``task.answer`` (module doc); nothing when the episode
    did not end with a reply without tool calls."""
    if res.status != "completed" or not res.turns or res.turns[-1].tool_calls:
        return
    if used >= task.budget.submissions:
        writer.write("submission", {"accepted": False, "reason": "submission budget exhausted",
                                    "source": "answer"})
        return
    box.write_text(task.answer, res.turns[-1].visible)
    submit("answer")


def _score(task, status, subs, sandboxes, writer):
    if status == "wall_time_exceeded":
        writer.write("verdict", {"submission": None, "reward": 0.0, "elapsed": 0.0, "timings": {},
                                 "reason": f"over the wall-time budget of {task.budget.wall_seconds} s: scored 0"})
        return 0.0, []
    if not subs:
        writer.write("verdict", {"submission": None, "reward": 0.0, "reason": "no submission", "elapsed": 0.0,
                                 "timings": {}})
        return 0.0, []
    chosen = list(range(len(subs))) if task.scoring == "best" else [len(subs) - 1]
    verdicts = []
    for i in chosen:
        v = verify(task, subs[i], sandboxes)
        verdicts.append(v)
        writer.write("verdict", {"submission": i, **v.as_dict()})
        if v.reward >= 1.0:
            break  # "best" cannot improve on 1.0: later submissions are not verified
    return max(v.reward for v in verdicts), verdicts


def _sum_parts(parts: list[dict]) -> dict:
    out: dict = {}
    for p in parts:
        for k, v in p.items():
            out[k] = out.get(k, 0.0) + v
    return out


def _rounded(d):
    return {k: _rounded(v) if isinstance(v, dict) else round(v, 6) for k, v in d.items()}


def rollout(job: dict) -> dict:
    """The picklable entry a worker runs: one job dict -> its summary (with label/expect/out)."""
    writer, provider, owned = TrajectoryWriter(job.get("out")), None, False
    try:
        if job.get("threads"):
            import torch
            torch.set_num_threads(int(job["threads"]))
        provider, owned = job_provider(job["provider"])
        backend = job.get("backend", "namespace")
        s = run_episode(job["task"], provider, writer, backend=backend,
                        harness=job.get("harness", job.get("seed")), yolo=job.get("yolo", False),
                        seed=job.get("seed"),
                        sandboxes=Sandboxes(backend, owner=job["owner"]) if job.get("owner") else None,
                        **job.get("sampling", {}))
    except Exception as e:  # noqa: BLE001 - one broken rollout is reported (status error), not fatal to a suite
        s = {"task": Path(job["task"]).name, "score": 0.0, "status": "error",
             "detail": f"{type(e).__name__}: {e}", "timings": {}}
    finally:
        writer.close()
        if provider is not None and owned:
            provider.close()
    return {**s, "label": job.get("label", ""), "expect": job.get("expect"), "out": job.get("out")}


def worker_pool(workers: int):
    """A pool of ``workers`` fresh (spawned) processes that run ``rollout`` jobs; a caller that
    runs jobs again and again (k3 rl: every step) keeps it, saving each step the start of its
    workers (an interpreter and torch's import, about 2 s each on 2 cores)."""
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    return ProcessPoolExecutor(max_workers=workers, mp_context=mp.get_context("spawn"))


def run_jobs(jobs: list[dict], workers: int = 1, use_ray: bool = False, pool=None) -> list[dict]:
    """Every job's summary, in the order given (``pool``: a ``worker_pool`` to run them in,
    instead of one of ``workers`` started for these jobs alone)."""
    if workers < 1:
        raise ConfigError(f"--workers must be >= 1, got {workers}")
    if use_ray:
        return _run_ray(jobs, workers)
    if pool is not None:
        return list(pool.map(rollout, jobs))
    if workers == 1:
        return [rollout(j) for j in jobs]
    with worker_pool(workers) as own:
        return list(own.map(rollout, jobs))


def _run_ray(jobs: list[dict], workers: int) -> list[dict]:
    try:
        import ray
    except ImportError:
        raise ConfigError("--ray needs the 'ray' package (pip install ray)") from None
    started = False
    if not ray.is_initialized():
        if os.environ.get("RAY_ADDRESS"):
            ray.init(address=os.environ["RAY_ADDRESS"])
        else:
            # a local instance; its workers inherit this process's environment (PYTHONPATH, K3_ENV_HOME)
            ray.init(num_cpus=workers, include_dashboard=False, log_to_driver=False)
        started = True
    try:
        remote = ray.remote(num_cpus=1)(rollout)
        return ray.get([remote.remote(j) for j in jobs])
    finally:
        if started:
            ray.shutdown()


def replay(path: str | Path, backend: str | None = None, task_dir: str | Path | None = None,
           out: str | Path | None = None) -> ReplayReport:
    """Run the recorded episode again (see module doc) and compare; ``out`` keeps the new trajectory."""
    recs = read_trajectory(path)
    header = recs[0]
    approvals = {r["call_id"]: r.get("approval") == "approved" for r in recs
                 if r["type"] == "policy" and r.get("action") == "ask"}
    provider = ReplayProvider(header, [r for r in recs if r["type"] == "turn"])
    cond = header["conditions"]
    writer = TrajectoryWriter(out)
    try:
        run_episode(task_dir or header["task"]["path"], provider, writer,
                    backend=backend or header["backend"], harness=cond["harness"],
                    yolo=header["policy"]["yolo"], approve=lambda req: approvals.get(req.call_id, False),
                    expect_digest=header["task"]["sha256"], effort=cond["effort"],
                    temperature=cond["temperature"], max_tokens=cond["max_tokens"],
                    context_tokens=cond["context_tokens"], seed=cond["seed"])
    finally:
        writer.close()
    return compare(recs, writer.records)
