"""The suites of ``k3 eval`` (SPEC §11); each writes checked rows (``k3.rl.eval_rows``).

- ``bpb``: bits per byte of a checkpoint on the validation split of local text (the default
  corpus, i.e. the demo's split, or ``--data``), at the run's longest training sequence length
  unless told: the sum of next-token losses over every validation token (non-overlapping windows,
  as ``Trainer.evaluate``) over ln 2 times the bytes of those tokens. One row.
- ``agent``: tasks (the starter tasks, task folders, or ``FAMILY:A:B`` held-out seeds) through a
  provider (a local checkpoint or an OpenAI-compatible endpoint), the real harness and sandboxes,
  the clean-room verifier; per task × effort × harness seed × sample one ``score`` row whose
  conditions are the ones the trajectory recorded (what was sent). Trajectories are kept under
  ``OUT/trajectories``. With ``hacks``, every task's hack transcripts are replayed through the same
  verification path (``hack_score`` rows, which must stay 0) beside the reference solutions
  (``solution_score`` rows, the positive control).
- ``harness``: the agent suite under several harness randomization seeds (default 0..4); the
  table adds each group's spread over the seeds.
- ``accept`` and ``retrieve``: long context (``k3.rl.longctx``) at the given lengths.
- ``sustain``: one long episode of the ``chain`` workload (``k3.tasks.families.chain``: N dependent
  steps, about 2·N tool calls) per seed, with the harness's compaction on (``context_tokens``)
  and off (never compacted); progress (the share of steps whose result file is right so far)
  after every tool call, read from the trajectory, against the context sent at that turn. Rows:
  the verifier's ``score``, and ``progress`` / ``sent_tokens`` at each tenth of the 2·N calls
  (``labels.share``); the whole curve is in the score row's ``detail``, with the count of turns
  whose context did not fit even compacted (``over_context_turns``). ``provider`` None runs
  the workload's reference solution (the positive control: progress reaches 1).
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import torch

from k3.data.corpus import load_corpus
from k3.data.packing import IGNORE_INDEX, build_token_stream, eval_batches
from k3.errors import ConfigError
from k3.infer.run_model import load_run_model
from k3.ops.loss import cross_entropy
from k3.rl.eval_rows import CONDITIONS, RowWriter, digest
from k3.rl.grpo import family_of, replay_hacks
from k3.rl.longctx import accept, make_retrieval, retrieve
from k3.rl.rollout import run_jobs
from k3.rl.trajectory import read_trajectory
from k3.tasks.families.base import read_meta
from k3.tasks.families.chain import Chain, chain_values, result_file
from k3.tasks.format import load_task
from k3.tasks.verify import Sandboxes
from k3.train.loop import token_byte_lengths
from k3.checkpoint.training import find_checkpoint, load_trainer_state

__all__ = ["run_bpb", "run_agent", "run_accept", "run_retrieve", "run_sustain", "agent_conditions",
           "progress_curve"]

COMPACTION_OFF = 10 ** 9  # context_tokens of a harness that never compacts


def _na(**given) -> dict:
    """Conditions with every key that does not apply stated as null."""
    return {k: given.get(k) for k in CONDITIONS}


# ----------------------------------------------------------------------------------------- bpb
def run_bpb(ckpt: str, model_cond: dict, out: Path, data: str | None = None, val_percent: int = 2,
            seq_len: int | None = None, batch_size: int = 4, max_batches: int = 0) -> list[dict]:
    t0 = time.monotonic()
    model, tok = load_run_model(ckpt)
    seq_len = seq_len or _run_seq_len(ckpt) or 1024
    if seq_len > model.config.max_position_embeddings:
        raise ConfigError(f"--seq-len {seq_len} is over the model's max_position_embeddings "
                          f"{model.config.max_position_embeddings}")
    corpus = load_corpus(data, val_percent)
    stream = build_token_stream(corpus, tok, "validation")
    token_bytes = token_byte_lengths(tok)
    nats, ntok, nbytes = 0.0, 0, 0
    with torch.no_grad():
        for x, y in eval_batches(stream, batch_size, seq_len, max_batches or None):
            logits = model(x).logits
            nats += cross_entropy(logits.flatten(0, 1), y.flatten(), IGNORE_INDEX, "sum").item()
            keep = y[y != IGNORE_INDEX]
            ntok += keep.numel()
            nbytes += int(token_bytes[keep].sum())
    if ntok == 0:
        raise ConfigError(f"the validation split of {data or 'the default corpus'} is empty")
    cond = _na(model=model_cond, setup={"data": corpus.name, "data_fingerprint": corpus.fingerprint,
                                        "val_percent": val_percent, "seq_len": seq_len,
                                        "max_batches": max_batches, "tokenizer": tok.fingerprint})
    w = RowWriter(out, "bpb")
    try:
        w.write("validation", "bits_per_byte", nats / math.log(2) / max(nbytes, 1), cond, {},
                wall_s=time.monotonic() - t0, tokens=ntok)
        w.write("validation", "nats_per_token", nats / ntok, cond, {}, wall_s=0.0, tokens=ntok)
    finally:
        w.close()
    return w.rows


def _run_seq_len(ckpt: str) -> int | None:
    """The longest sequence length of the run's curriculum, when ``ckpt`` is a training run."""
    p = Path(ckpt)
    c = p if (p / "trainer_state.pt").is_file() else find_checkpoint(p)
    if c is None or not (c / "trainer_state.pt").is_file():
        return None
    cur = load_trainer_state(c)["train_config"].get("curriculum") or []
    return max((int(t) for _, t in cur), default=None)


# --------------------------------------------------------------------------------------- agent
def agent_conditions(header: dict, model_cond: dict) -> dict:
    """A trajectory header's conditions as a row's: what was sent, with the tools and prompts as
    names and digests."""
    c = header["conditions"]
    harness = c["harness"]
    return _na(model=model_cond, harness=harness,
               tools={"names": sorted(t["function"]["name"] for t in c["tools"]), "sha256": digest(c["tools"])},
               prompt={"template": harness.get("template"), "system_sha256": digest(c["prompt"]["system"]),
                       "user_sha256": digest(c["prompt"]["user"])},
               budget=c["budget"], effort=c["effort"], temperature=c["temperature"],
               seeds={"sampling": c["seed"], "harness": harness.get("seed")},
               setup={"max_tokens": c["max_tokens"], "context_tokens": c["context_tokens"],
                      "backend": header["backend"], "task_sha256": header["task"]["sha256"]})


def run_agent(provider: dict, model_cond: dict, tasks: list[str], out: Path, *, efforts: list[str],
              temperature: float, samples: int, harness_seeds: list[int | None], workers: int = 1,
              max_tokens: int = 1024, backend: str = "namespace", hacks: bool = True, suite: str = "agent",
              use_ray: bool = False, log=print) -> list[dict]:
    if samples < 1:
        raise ConfigError(f"--samples must be >= 1, got {samples}")
    loaded = [load_task(t, transcripts=True) for t in tasks]
    jobs = []
    for t in loaded:
        for e in efforts:
            for h in harness_seeds:
                for k in range(samples):
                    name = f"{t.id}.{e}.h{'c' if h is None else h}.s{k}.jsonl"
                    jobs.append({"task": str(t.root), "provider": provider, "seed": k, "harness": h,
                                 "backend": backend, "label": f"{t.id}|{e}|{h}|{k}",
                                 "out": str(out / "trajectories" / name), "threads": 1 if workers > 1 else None,
                                 "sampling": {"effort": e, "temperature": temperature, "max_tokens": max_tokens}})
    Sandboxes(backend).close()  # build the base image once, before the workers race for it
    log(f"agent: {len(jobs)} episodes ({len(loaded)} tasks × {len(efforts)} efforts × "
        f"{len(harness_seeds)} harness seeds × {samples} samples), {workers} workers")
    results = run_jobs(jobs, workers=workers, use_ray=use_ray)
    w = RowWriter(out, suite)
    try:
        for t, job, res in zip([t for t in loaded for _ in range(len(efforts) * len(harness_seeds) * samples)],
                               jobs, results):
            _, e, h, k = job["label"].split("|")
            hseed = None if h == "None" else int(h)
            labels = {"family": family_of(t.id), "effort": e, "harness": hseed}
            path = Path(job["out"])
            recs = read_trajectory(path) if path.is_file() and path.stat().st_size else None
            if recs is None:  # the episode failed before its header: conditions from the job
                cond = _na(model=model_cond, effort=e, temperature=temperature,
                           seeds={"sampling": int(k), "harness": hseed},
                           setup={"max_tokens": max_tokens, "backend": backend})
            else:
                cond = agent_conditions(recs[0], model_cond)
            value = None if res["status"] == "error" else float(res["score"])
            w.write(t.id, "score", value, cond, labels, sample=int(k), wall_s=res.get("timings", {}).get("total", 0.0),
                    tokens=res.get("tokens", 0) or 0,
                    detail={"status": res["status"], "error": res.get("detail")} if value is None else None)
        if hacks:
            _hack_rows(loaded, w, model_cond, backend)
    finally:
        w.close()
    return w.rows


def _hack_rows(tasks, w: RowWriter, model_cond: dict, backend: str) -> None:
    """Hack transcripts (must score 0) and reference solutions (the control) through the
    rollout's own verification path."""
    with_hacks = [t for t in tasks if t.hacks]
    if not with_hacks:
        return
    sb = Sandboxes(backend)
    try:
        for metric, solutions in (("hack_score", False), ("solution_score", True)):
            t0 = time.monotonic()
            rows = replay_hacks([t for t in with_hacks if t.solution or not solutions], sb, solutions=solutions)
            dt = (time.monotonic() - t0) / max(len(rows), 1)
            for task_id, path, score, expect in rows:
                cond = _na(model=model_cond, setup={"provider": "scripted", "transcript": Path(path).name,
                                                    "expect_reward": expect, "backend": backend})
                w.write(f"{task_id}/{Path(path).stem}", metric, score, cond, {"family": family_of(task_id)},
                        wall_s=dt)
    finally:
        sb.close()


# -------------------------------------------------------------------------------- long context
def run_accept(ckpt: str, model_cond: dict, out: Path, lengths: list[int], decode_tokens: int = 16) -> list[dict]:
    model, _ = load_run_model(ckpt)
    w = RowWriter(out, "accept")
    try:
        for r in accept(model, lengths, decode_tokens=decode_tokens):
            T, ok = r["length"], r["ok"]
            setup = {"decode_tokens": decode_tokens, "threads": torch.get_num_threads(), "dtype": "float32",
                     "prefill": "random ids, chunks of 512"}
            cond = _na(model=model_cond, seeds={"ids": 0}, setup=setup)
            detail = {k: r[k] for k in ("error", "peak_note") if r.get(k)}
            wall = r.get("prefill_seconds", 0.0) + (r.get("decode_seconds") or 0.0)
            for metric in ("ok", "prefill_s_per_token", "decode_s_per_token", "cache_bytes", "peak_rss_bytes"):
                v = r.get(metric)
                w.write(f"T={T}", metric, None if v is None else float(v), cond, {"T": T}, wall_s=wall,
                        tokens=T + decode_tokens if ok else 0, detail=detail)
    finally:
        w.close()
    return w.rows


def run_retrieve(ckpt: str, model_cond: dict, out: Path, lengths: list[int], depths: list[float],
                 kinds: list[str], seeds: int = 3, n_keys: int = 8, max_new_tokens: int = 8) -> list[dict]:
    model, tok = load_run_model(ckpt)
    if max(lengths) + max_new_tokens > model.config.max_position_embeddings:
        raise ConfigError(f"--lengths up to {max(lengths)} + {max_new_tokens} answer tokens is over the model's "
                          f"max_position_embeddings {model.config.max_position_embeddings}")
    items = [make_retrieval(kind, tok, T, d, s, n_keys=n_keys if kind == "multikey" else 1)
             for kind in kinds for T in lengths for d in depths for s in range(seeds)]
    w = RowWriter(out, "retrieve")
    try:
        for it, r in zip(items, retrieve(model, tok, items, max_new_tokens=max_new_tokens)):
            cond = _na(model=model_cond, temperature=0.0, seeds={"generator": it.seed},
                       setup={"kind": it.kind, "length": it.length, "depth": it.depth,
                              "n_keys": n_keys if it.kind == "multikey" else None,
                              "max_new_tokens": max_new_tokens, "decoding": "greedy"})
            w.write(f"{it.kind}/T={it.length}/depth={it.depth}/seed={it.seed}", "correct", float(r["correct"]),
                    cond, {"kind": it.kind, "T": it.length, "depth": it.depth}, wall_s=r["seconds"],
                    tokens=it.tokens, detail={"output": r["output"], "answer": it.answer, "query": it.query})
    finally:
        w.close()
    return w.rows


# ------------------------------------------------------------------------------------- sustain
def progress_curve(records: list[dict], values: list[int]) -> list[list]:
    """``[calls, sent_tokens, progress]`` after every tool call of a chain episode: ``progress`` is
    the share of steps whose result file holds the right number after that call (a later write
    to the same file replaces the earlier one); ``sent_tokens`` the context sent for its turn."""
    index = {result_file(k): k for k in range(1, len(values) + 1)}
    right: dict[int, bool] = {}
    sent, calls, out = 0, 0, []
    for r in records:
        if r["type"] == "turn":
            sent = int(r.get("metadata", {}).get("sent_tokens", 0))
        elif r["type"] == "tool":
            calls += 1
            k = index.get(str(r["arguments"].get("path", "")).removeprefix("/workspace/").removeprefix("./"))
            if r["name"] == "write" and k is not None and not r["result"]["error"]:
                right[k] = str(r["arguments"].get("content", "")).strip() == str(values[k - 1])
            out.append([calls, sent, sum(right.values()) / len(values)])
    return out


def run_sustain(provider: dict | None, model_cond: dict, out: Path, *, steps: int, seeds: list[int],
                context_tokens: int, effort: str, temperature: float, max_tokens: int = 256,
                backend: str = "namespace", workers: int = 1, use_ray: bool = False, log=print) -> list[dict]:
    if context_tokens < 1:
        raise ConfigError(f"--context-tokens must be >= 1, got {context_tokens}")
    fam = Chain(steps)
    tasks = [fam.generate(s, out / "tasks", overwrite=True) for s in seeds]
    jobs = []
    for t in tasks:
        for mode, ctx in (("on", context_tokens), ("off", COMPACTION_OFF)):
            spec = provider or {"kind": "scripted", "transcript": str(t / "solution" / "solve.json")}
            jobs.append({"task": str(t), "provider": spec, "seed": 0, "harness": None, "backend": backend,
                         "label": mode, "out": str(out / "trajectories" / f"{t.name}.compaction-{mode}.jsonl"),
                         "threads": 1 if workers > 1 else None,
                         "sampling": {"effort": effort, "temperature": temperature, "max_tokens": max_tokens,
                                      "context_tokens": ctx}})
    Sandboxes(backend).close()
    log(f"sustain: {len(jobs)} episodes of {steps} chained steps (~{2 * steps} tool calls each), "
        f"compaction on ({context_tokens} tokens) and off")
    results = run_jobs(jobs, workers=workers, use_ray=use_ray)
    w = RowWriter(out, "sustain")
    try:
        for job, res in zip(jobs, results):
            values = chain_values(read_meta(job["task"])["spec"])
            path = Path(job["out"])
            recs = read_trajectory(path) if path.is_file() and path.stat().st_size else None
            over = 0
            if recs is None:
                cond = _na(model=model_cond, effort=effort, temperature=temperature, seeds={"sampling": 0},
                           setup={"compaction": job["label"], "context_tokens": job["sampling"]["context_tokens"]})
                curve = []
            else:
                cond = agent_conditions(recs[0], model_cond)
                cond["setup"] = {**cond["setup"], "compaction": job["label"], "steps": steps}
                curve = progress_curve(recs, values)
                over = sum(1 for r in recs if r["type"] == "turn" and r.get("metadata", {}).get("over_context"))
            item = Path(job["task"]).name
            labels = {"compaction": job["label"]}
            value = None if res["status"] == "error" else float(res["score"])
            w.write(item, "score", value, cond, labels, wall_s=res.get("timings", {}).get("total", 0.0),
                    tokens=res.get("tokens", 0) or 0,
                    detail={"status": res["status"], "error": res.get("detail"), "curve": curve,
                            "over_context_turns": over})
            for tenth in range(1, 11):
                calls = -(-2 * steps * tenth // 10)
                at = [c for c in curve if c[0] <= calls]
                point = at[-1] if at else None
                for metric, i in (("progress", 2), ("sent_tokens", 1)):
                    w.write(item, metric, None if point is None else float(point[i]), cond,
                            {**labels, "share": tenth / 10}, detail={"calls": calls, "made": point and point[0]})
    finally:
        w.close()
    return w.rows
