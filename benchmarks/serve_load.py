"""Load and reliability of ``k3 serve`` (issue 11 "Reliability"; SPEC §8 JSON lines).

A random-weight model of ``--preset`` and a small trained tokenizer are saved to a temp dir and
``k3 serve`` runs on them as a subprocess on a free loopback port (``--port 0``); the server is
always stopped at the end. Parts (``--parts``, default all):

1. ``streams``: 64 concurrent streaming chat clients, a quarter leaving after a random number of
   SSE lines (0 = right after the headers). Every other client must get a complete stream (a chunk
   with a ``finish_reason``, then ``data: [DONE]``, no error chunk); afterwards ``/metrics`` must show
   0 active sequences and 0 queued within a bounded wait.
2. ``hostile``: 1,000 malformed or hostile requests (bad JSON, wrong types, huge ``max_tokens``,
   unknown roles, 10 MB bodies, invalid UTF-8, unknown model, missing/wrong auth, ...) against a
   server started with ``--api-key`` (the key is sent on all but the auth cases). Status classes are
   counted: every answer must be 4xx with an OpenAI-style error body, 0 5xx; then a valid request
   (the positive control) gets 200, ``/health`` is ok and the server's own counters show no 5xx.
3. ``throughput``: aggregate output tokens/s with 1, 8 and 32 concurrent greedy completions
   (fixed ``max_tokens``, ``ignore_eos``, streamed as SSE unless ``--no-stream``), i.e. all
   completion tokens ÷ the wall time from the first send to the last reply; the server runs with
   ``--max-batch 32``; the best of ``--repeats`` rounds is reported (the machine may be shared).
   Ratio of 8 vs 1 (target >= 4, PASS / MISS).
4. ``engine``: the same requests straight into an in-process ``Engine`` (no HTTP), run right
   before the server's at each level when both parts are given, so the two ratios share the
   machine's load: how much of the server's ratio is the engine's batching.

Must-hold rows print PASS / FAIL (and make the exit status 1 when one fails).

``python benchmarks/serve_load.py [--preset nano] [--parts streams,hostile,throughput,engine] [--gen 64]
[--threads 1] [--repeats 2] [--no-stream]``; prints a table and appends JSON lines to ``benchmarks/results/serve_load.jsonl``.
Exit status 1 when a must-hold figure (0 errors, 0 5xx, nothing left active) fails.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from k3.serve.launch import ServerProcess

sys.path.insert(0, str(Path(__file__).parent))
from _timing import append_results  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "serve_load.jsonl"
CHAT, COMP = "/v1/chat/completions", "/v1/completions"
KEY = "load-test-key"


def build_checkpoint(preset: str, d: Path) -> str:
    """Save a random ``preset`` model and a 400-token tokenizer into ``d``; returns the model id
    (the folder name, which ``k3 serve`` serves by default)."""
    import torch

    from k3.checkpoint import save_pretrained
    from k3.config import get_preset
    from k3.data.tokenizer import train_tokenizer
    from k3.model.decoder import K3ForCausalLM

    torch.manual_seed(0)
    save_pretrained(K3ForCausalLM(get_preset(preset)), d)
    train_tokenizer(["hello world, the quick brown fox jumps over the lazy dog. " * 30], vocab_size=400).save(d)
    return d.name


class Server(ServerProcess):
    """``k3 serve`` as a subprocess (``k3.serve.launch``) plus the 5xx total of its counters."""

    def __init__(self, ckpt: Path, threads: int, *flags: str):
        super().__init__(ckpt, *flags, threads=threads, start_timeout=300)

    def metrics(self, timeout: float = 30.0) -> dict[str, float]:
        """Samples of ``/metrics`` plus ``5xx``: the sum of 5xx request counters."""
        out = super().metrics(timeout)
        out["5xx"] = sum(v for k, v in out.items() if k.startswith("k3_http_requests_total") and 'status="5' in k)
        return out


# --------------------------------------------------------------------------------- part 1: streams
def _stream(url: str, body: dict, leave_after: int | None) -> str | None:
    """One streaming chat; ``leave_after`` lines then close (None = read to the end). Returns an
    error description, or None when the stream was complete (or left on purpose)."""
    with httpx.Client(timeout=300) as c, c.stream("POST", url + CHAT, json=body) as r:
        if r.status_code != 200:
            return f"status {r.status_code}"
        if leave_after == 0:
            return None  # leave right after the headers
        lines = []
        for line in r.iter_lines():
            if leave_after is not None and len(lines) >= leave_after:
                return None
            if line:
                lines.append(line)
    if leave_after is not None:
        return None  # the stream ended before its leaving point: nothing to check
    if not lines or lines[-1] != "data: [DONE]":
        return f"no [DONE] (last line {lines[-1:]!r})"
    chunks = [json.loads(x[6:]) for x in lines[:-1]]
    if any("error" in ch for ch in chunks):
        return "error chunk"
    if not any(c.get("finish_reason") for ch in chunks for c in ch.get("choices", [])):
        return "no finish_reason"
    return None


def part_streams(srv: Server, model: str, n: int, gen: int, seed: int) -> dict:
    rng = random.Random(seed)
    body = {"model": model, "messages": [{"role": "user", "content": "hello there"}], "max_tokens": gen,
            "temperature": 0, "stream": True, "ignore_eos": True}
    leave = [rng.randint(0, gen) if i % 4 == 0 else None for i in range(n)]
    errors: list[str] = []

    def client(i: int) -> None:
        try:
            e = _stream(srv.url, body, leave[i])
        except Exception as ex:  # noqa: BLE001 - a leaver's own close is not an error; others' are counted
            e = None if leave[i] is not None else f"{type(ex).__name__}: {ex}"
        if e is not None:
            errors.append(f"client {i}: {e}")

    t0 = time.perf_counter()
    ts = [threading.Thread(target=client, args=(i,)) for i in range(n)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    wall = time.perf_counter() - t0
    idle = srv.idle(30.0)
    m = srv.metrics()
    return {"errors": errors, "stayers": sum(x is None for x in leave), "leavers": sum(x is not None for x in leave),
            "idle": idle, "active": m["k3_active_sequences"], "queued": m["k3_queue_depth"],
            "cancelled": m["k3_cancelled_requests_total"], "wall": wall}


# -------------------------------------------------------------------------------- part 2: hostile
def hostile_cases(model: str, n: int, seed: int) -> list[tuple[str, str, dict, bytes]]:
    """``n`` (kind, path, headers, body) requests, each invalid by construction; cycled over the kinds
    with random details. The valid key is sent on all but the auth kinds."""
    rng = random.Random(seed)
    good = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    comp = {"model": model, "prompt": "hi", "max_tokens": 2}
    big = json.dumps({**good, "messages": [{"role": "user", "content": "x" * (10 << 20)}]}).encode()
    junk = [b"\xff", b"\xfe\xfe", b"\xc0\xaf", b"\xed\xa0\x80", b"\x80", b"\xf8\x88\x80\x80\x80"]
    wrong = {"max_tokens": ["2", 2.5, [], {}, True], "temperature": ["hot", None, [0]], "model": [5, None, ["m"]],
             "messages": ["hi", 3, {"role": "user"}, [5]], "stream": ["yes", 1], "top_p": ["1", {}]}

    def dump(d): return json.dumps(d).encode()

    kinds = {
        "bad_json": lambda: (CHAT, (s := dump(good))[:rng.randrange(1, len(s) - 1)]),
        "not_object": lambda: (rng.choice([CHAT, COMP]), dump(rng.choice([[1, 2], 3, "s", None, []]))),
        "wrong_type": lambda: (CHAT, dump({**good, (f := rng.choice(list(wrong))): rng.choice(wrong[f])})),
        "huge_max_tokens": lambda: (rng.choice([CHAT, COMP]),
                                    dump({**rng.choice([good, comp]), "max_tokens": 10 ** rng.randint(5, 18)})),
        "unknown_role": lambda: (CHAT, dump({**good, "messages": [{"role": f"wizard{rng.randrange(99)}",
                                                                    "content": "hi"}]})),
        "body_10mb": lambda: (CHAT, big),
        "invalid_utf8": lambda: rng.choice([
            (COMP, b'{"model": "%s", "max_tokens": 2, "prompt": "a%sb"}' % (model.encode(), rng.choice(junk))),
            (CHAT, dump(good).replace(b'"hi"', b'"h%si"' % rng.choice(junk)))]),
        "unknown_model": lambda: (rng.choice([CHAT, COMP]),
                                  dump({**rng.choice([good, comp]), "model": f"gpt-{rng.randrange(1000)}"})),
        "missing_auth": lambda: (CHAT, dump(good)),
        "wrong_auth": lambda: (COMP, dump(comp)),
        "unknown_field": lambda: (CHAT, dump({**good, f"x_{rng.randrange(99)}": 1})),
        "out_of_range": lambda: (CHAT, dump({**good, **rng.choice([{"temperature": 9}, {"top_p": 0}, {"n": 3},
                                                                   {"max_tokens": 0}, {"min_p": 2}])})),
        "token_outside_vocab": lambda: (COMP, dump({**comp, "prompt": [1, 10 ** 7 + rng.randrange(99)]})),
        "missing_field": lambda: (rng.choice([CHAT, COMP]), dump({"messages": good["messages"]})),
        "lone_surrogate": lambda: rng.choice([
            (CHAT, dump({**good, "messages": [{"role": "user", "content": chr(rng.randint(0xD800, 0xDFFF))}]})),
            (COMP, dump({**comp, "prompt": "a" + chr(rng.randint(0xD800, 0xDFFF))}))]),
        "deep_nesting": lambda: (CHAT, b"[" * 200_000 + b"]" * 200_000),
    }
    names = list(kinds)
    out = []
    for i in range(n):
        kind = names[i % len(names)]
        path, body = kinds[kind]()
        headers = {"content-type": "application/json"}
        if kind == "wrong_auth":
            headers["authorization"] = rng.choice([f"Bearer {KEY}x", KEY, "Bearer", f"Basic {KEY}", f"bearer {KEY}"])
        elif kind != "missing_auth":
            headers["authorization"] = f"Bearer {KEY}"
        out.append((kind, path, headers, body))
    return out


def part_hostile(srv: Server, model: str, n: int, seed: int, workers: int = 8) -> dict:
    cases = hostile_cases(model, n, seed)
    classes: dict[str, int] = {}
    bad: list[str] = []
    lock = threading.Lock()

    def send(case) -> None:
        kind, path, headers, body = case
        try:
            r = httpx.post(srv.url + path, content=body, headers=headers, timeout=120)  # a connection each
            cls = f"{r.status_code // 100}xx"
            err = r.json().get("error") if r.headers.get("content-type", "").startswith("application/json") else None
            ok_body = isinstance(err, dict) and isinstance(err.get("message"), str) and "type" in err
            why = err.get("message", "")[:100] if isinstance(err, dict) else r.text[:100]
        except Exception as ex:  # noqa: BLE001 - counted as a transport failure
            cls, ok_body, why = f"failed ({type(ex).__name__})", False, str(ex)[:100]
        with lock:
            classes[cls] = classes.get(cls, 0) + 1
            if cls != "4xx" or not ok_body:
                bad.append(f"{kind} {path}: {cls}, error body ok: {ok_body}: {why}")

    t0 = time.perf_counter()
    with ThreadPoolExecutor(workers) as ex:
        list(ex.map(send, cases))
    wall = time.perf_counter() - t0
    control = httpx.post(srv.url + CHAT, json={"model": model, "messages": [{"role": "user", "content": "hi"}],
                                               "max_tokens": 2}, headers={"authorization": f"Bearer {KEY}"},
                         timeout=120)
    return {"classes": classes, "bad": bad, "control": control.status_code, "healthy": srv.healthy(),
            "server_5xx": srv.metrics()["5xx"], "kinds": len({c[0] for c in cases}), "wall": wall}


# ------------------------------------------------------------- part 3: throughput (+ the engine alone)
def _body(model: str, gen: int, salt: int, stream: bool) -> dict:
    body = {"model": model, "prompt": f"the quick brown fox {salt}", "max_tokens": gen, "temperature": 0,
            "ignore_eos": True}
    if stream:
        body.update(stream=True, stream_options={"include_usage": True})
    return body


def _complete(url: str, model: str, gen: int, salt: int, stream: bool = True) -> int:
    """One greedy completion of ``gen`` tokens (streamed: SSE with a final usage chunk); returns
    its completion tokens."""
    if not stream:
        r = httpx.post(url + COMP, json=_body(model, gen, salt, False), timeout=1800)
        r.raise_for_status()
        return r.json()["usage"]["completion_tokens"]
    usage = None
    with httpx.Client(timeout=1800) as c, c.stream("POST", url + COMP, json=_body(model, gen, salt, True)) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                usage = chunk.get("usage") or usage
    return usage["completion_tokens"] if usage else 0


class EngineAlone:
    """The throughput requests straight into an in-process ``Engine`` built as ``k3 serve`` builds
    it (``--max-batch 32``, prefill chunk 512, 256 MiB prefix cache): the same prompts
    (``the quick brown fox {i}``), ``gen`` greedy tokens with ``ignore_eos``, all ``c`` submitted at
    once, wall time to the last result. Splits the server's ratio into the engine's batching and
    the HTTP layer. ``run(c) -> (tokens/s, mean decode batch)``."""

    def __init__(self, ckpt: Path, gen: int, threads: int, device: str):
        import torch

        from k3.infer.engine import Engine
        from k3.infer.run_model import load_run_model

        torch.set_num_threads(threads)
        model, self.tok = load_run_model(ckpt, device)
        self.gen, self.params = gen, {"max_tokens": gen, "temperature": 0.0, "ignore_eos": True}
        self.eng = Engine(model, max_batch=32, prefill_chunk=512, tokenizer=self.tok, prefix_cache_bytes=256 << 20)
        self.eng.generate([self.tok.encode("the quick brown fox -1")], {**self.params, "max_tokens": 4})

    def run(self, c: int) -> tuple[float, float, float]:
        """(tokens / wall s, tokens / CPU s of this process, mean decode batch)."""
        prompts = [self.tok.encode(f"the quick brown fox {i}") for i in range(c)]
        s0 = self.eng.stats()["decode_steps"]
        t0, cpu0 = time.perf_counter(), time.process_time()
        res = self.eng.generate(prompts, self.params)
        dt, cpu = time.perf_counter() - t0, time.process_time() - cpu0
        steps = self.eng.stats()["decode_steps"] - s0
        if [len(r.token_ids) for r in res] != [self.gen] * c:
            raise RuntimeError(f"engine at {c}: expected {self.gen} tokens per request")
        return c * self.gen / dt, c * self.gen / cpu, c * (self.gen - 1) / steps

    def close(self) -> None:
        self.eng.close()


def part_throughput(srv: Server | None, model: str, gen: int, repeats: int, stream: bool,
                    engine: EngineAlone | None, levels=(1, 8, 32)) -> dict:
    """Aggregate output tokens/s per concurrency level through the server (``srv``) and/or the
    engine alone, ``repeats`` rounds over the levels, the engine's run right before the server's
    at each level (so both see the same machine load); a warm-up first. Also the mean decode batch
    (tokens after the first per request / decode steps). The caller reports the best round."""
    if srv is not None:
        _complete(srv.url, model, 4, -1, stream)
        _complete(srv.url, model, 4, -2, stream)
    out: dict = {k: {c: [] for c in levels} for k in ("server", "engine")}
    per_cpu: dict = {k: {c: [] for c in levels} for k in ("server", "engine")}
    batch: dict = {k: {c: [] for c in levels} for k in ("server", "engine")}
    for _ in range(repeats):
        for c in levels:
            if engine is not None:
                tps, tpc, b = engine.run(c)
                out["engine"][c].append(tps)
                per_cpu["engine"][c].append(tpc)
                batch["engine"][c].append(b)
                print(f"  engine alone: {c:2d} at once: {tps:.1f} tokens/s, {tpc:.1f} tokens/CPU-s, "
                      f"mean decode batch {b:.2f}", flush=True)
            if srv is None:
                continue
            steps0 = srv.metrics().get("k3_decode_steps_total")
            t0, cpu0 = time.perf_counter(), _cpu_seconds(srv.proc.pid)
            with ThreadPoolExecutor(c) as ex:
                toks = list(ex.map(lambda i: _complete(srv.url, model, gen, i, stream), range(c)))
            dt, cpu = time.perf_counter() - t0, _cpu_seconds(srv.proc.pid) - cpu0
            if toks != [gen] * c:
                raise RuntimeError(f"throughput at {c}: expected {gen} tokens per request, got {toks}")
            out["server"][c].append(sum(toks) / dt)
            per_cpu["server"][c].append(sum(toks) / cpu)
            steps1 = srv.metrics().get("k3_decode_steps_total")
            b = c * (gen - 1) / (steps1 - steps0) if steps0 is not None and steps1 > steps0 else float("nan")
            batch["server"][c].append(b)
            print(f"  server: {c:2d} concurrent: {out['server'][c][-1]:.1f} tokens/s ({dt:.1f} s), "
                  f"{per_cpu['server'][c][-1]:.1f} tokens/CPU-s, mean decode batch {b:.2f}", flush=True)
    return {"tps": out, "per_cpu": per_cpu, "batch": batch}


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (all its threads; ``/proc``, Linux)."""
    import os

    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# -------------------------------------------------------------------------------------------- main
def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="nano")
    p.add_argument("--parts", default="streams,hostile,throughput",
                   help="any of streams, hostile, throughput, engine (the engine alone, in-process)")
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--hostile", type=int, default=1000)
    p.add_argument("--gen", type=int, default=64, help="max_tokens of each stream / throughput request")
    p.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of the server")
    p.add_argument("--repeats", type=int, default=2, help="throughput rounds (the best is reported)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-stream", dest="stream", action="store_false",
                   help="throughput with whole (non-streamed) replies instead of SSE streams")
    args = p.parse_args(argv)
    parts = set(args.parts.split(","))
    unknown = parts - {"streams", "hostile", "throughput", "engine"}
    if unknown:
        p.error(f"--parts: unknown part(s) {sorted(unknown)}")
    where = f"{args.preset}, {args.device}" + (f", {args.threads} threads" if args.device == "cpu" else "")
    rows, failed = [], []

    def emit(metric, value, baseline=None, must=None, target=None, **extra):
        """``must``: a must-hold fact (PASS / FAIL, and the exit status); ``target``: the issue's
        minimum for the ratio (PASS / MISS)."""
        ratio = value / baseline if baseline else None
        verdict = ""
        if must is not None:
            verdict = "PASS" if must else "FAIL"
            if not must:
                failed.append(metric)
        elif target is not None and ratio is not None:
            verdict = f"{'PASS' if ratio >= target else 'MISS'} (>= {target})"
        rows.append(dict(bench="serve_load", config=where, metric=metric, value=value, baseline=baseline,
                         ratio=ratio, verdict=verdict or None, **extra))
        b = "" if baseline is None else f"{baseline:12.2f}"
        r = "" if ratio is None else f"{ratio:8.2f}"
        print(f"{metric:34s} {value:12.2f} {b:>12s} {r:>8s}  {verdict}", flush=True)

    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Path(tmp) / args.preset
        model = build_checkpoint(args.preset, ckpt)
        base = ["--device", args.device]
        print(f"{'metric':34s} {'value':>12s} {'baseline':>12s} {'ratio':>8s}  verdict  ({where})", flush=True)
        if "streams" in parts:
            with Server(ckpt, args.threads, *base) as srv:
                s = part_streams(srv, model, args.clients, args.gen, args.seed)
            for e in s["errors"][:10]:
                print("  stream error:", e)
            emit("stream_errors_among_stayers", len(s["errors"]), must=not s["errors"], stayers=s["stayers"],
                 leavers=s["leavers"], wall_s=s["wall"], gen=args.gen)
            emit("active_after", s["active"], must=s["idle"] and s["active"] == 0)
            emit("queued_after", s["queued"], must=s["idle"] and s["queued"] == 0)
            emit("cancelled_total", s["cancelled"])
        if "hostile" in parts:
            with Server(ckpt, args.threads, *base, "--api-key", KEY) as srv:
                h = part_hostile(srv, model, args.hostile, args.seed)
            for e in h["bad"][:10]:
                print("  hostile not 4xx/error body:", e)
            c = h["classes"]
            emit("hostile_4xx", c.get("4xx", 0), baseline=args.hostile, must=c.get("4xx", 0) == args.hostile,
                 classes=c, kinds=h["kinds"], wall_s=h["wall"])
            emit("hostile_5xx", c.get("5xx", 0), must=c.get("5xx", 0) == 0 and h["server_5xx"] == 0,
                 server_counted_5xx=h["server_5xx"])
            emit("hostile_bad_answers", len(h["bad"]), must=not h["bad"])
            emit("health_ok_after", float(h["healthy"] and h["control"] == 200), must=h["healthy"],
                 control_status=h["control"])
        if parts & {"throughput", "engine"}:
            eng = EngineAlone(ckpt, args.gen, args.threads, args.device) if "engine" in parts else None
            try:
                if "throughput" in parts:
                    with Server(ckpt, args.threads, *base, "--max-batch", "32") as srv:
                        res = part_throughput(srv, model, args.gen, args.repeats, args.stream, eng)
                else:
                    res = part_throughput(None, model, args.gen, args.repeats, args.stream, eng)
            finally:
                if eng is not None:
                    eng.close()
            mode = "streamed" if args.stream else "whole replies"
            for who, prefix in (("server", "tps"), ("engine", "engine_tps")):
                runs = res["tps"][who]
                if not runs[1]:
                    continue
                t = {c: max(v) for c, v in runs.items()}
                unit = (f"aggregate output tokens/s, best of {args.repeats}"
                        + (f", {mode}" if who == "server" else ", engine alone"))
                emit(f"{prefix}_c1", t[1], unit=unit, gen=args.gen, runs=runs[1])
                emit(f"{prefix}_c8_vs_c1", t[8], baseline=t[1], target=4.0, unit=unit, gen=args.gen, runs=runs[8],
                     mean_decode_batch=res["batch"][who][8])
                emit(f"{prefix}_c32_vs_c1", t[32], baseline=t[1], unit=unit, gen=args.gen, runs=runs[32],
                     mean_decode_batch=res["batch"][who][32])
                # per CPU second of the serving process: what a machine not shared would give
                pc = {c: max(v) for c, v in res["per_cpu"][who].items()}
                unit_cpu = unit.replace("tokens/s", "tokens per CPU second")
                emit(f"{prefix}_per_cpu_c1", pc[1], unit=unit_cpu, runs=res["per_cpu"][who][1])
                emit(f"{prefix}_per_cpu_c8_vs_c1", pc[8], baseline=pc[1], unit=unit_cpu, runs=res["per_cpu"][who][8])
                emit(f"{prefix}_per_cpu_c32_vs_c1", pc[32], baseline=pc[1], unit=unit_cpu,
                     runs=res["per_cpu"][who][32])
    append_results(RESULTS, rows)
    if failed:
        print("FAILED:", ", ".join(failed))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
