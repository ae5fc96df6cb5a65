"""Long context on the ``tiny`` preset: chunked prefill of a T-token prompt, then 16 decode steps.

For each T (default 1024, 4096, 16384, 65536) a fresh subprocess builds the model (random init,
fp32, ``max_position_embeddings`` raised to fit T: K3 is NoPE, so nothing else depends on it),
prefills the prompt through a ``K3Cache`` in chunks of ``--chunk`` tokens (chunk KDA, query-chunked
naive MLA over the cached latents), then decodes 16 greedy tokens (recurrent KDA, absorbed MLA).
It reports prefill tokens/s, decode ms/token, the cache bytes and the peak RSS of that process
(``VmHWM`` from /proc/self/status, so each T's peak is its own; ``model_rss_mb`` is VmHWM right
after building the model, before any token).

Prints a table and appends JSON lines (SPEC §8) to benchmarks/results/long_context.jsonl; the
baseline of each metric is its value at the smallest T (ratio = growth with context).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results" / "long_context.jsonl"
METRICS = ("prefill_tokens_per_s", "decode_ms_per_token", "peak_rss_mb", "cache_mb")


def vm_hwm_mb() -> float:
    """Peak resident set size of this process so far, MiB (Linux /proc)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("VmHWM not found in /proc/self/status")


def run_one(preset: str, T: int, chunk: int, decode: int, threads: int) -> dict:
    import torch

    from k3.config import get_preset
    from k3.model.cache import cache_bytes_per_sequence
    from k3.model.decoder import K3ForCausalLM

    torch.set_num_threads(threads)
    torch.set_flush_denormal(True)
    torch.manual_seed(0)
    cfg = get_preset(preset)
    cfg = cfg.replace(max_position_embeddings=max(cfg.max_position_embeddings, T + decode))
    model = K3ForCausalLM(cfg).eval()
    model_rss = vm_hwm_mb()
    ids = torch.randint(3, cfg.vocab_size, (1, T))
    cache = model.new_cache(1)
    with torch.no_grad():
        t0 = time.perf_counter()
        for s in range(0, T, chunk):
            logits = model(ids[:, s:s + chunk], cache=cache, logits_to_keep=1).logits[:, -1]
        prefill_s = time.perf_counter() - t0
        steps = []
        for _ in range(decode):
            nxt = logits.argmax(-1, keepdim=True)
            t1 = time.perf_counter()
            logits = model(nxt, cache=cache, logits_to_keep=1).logits[:, -1]
            steps.append(time.perf_counter() - t1)
    steps.sort()
    want = cache_bytes_per_sequence(cfg, T + decode, torch.float32)["total"]
    if cache.nbytes() != want:
        raise RuntimeError(f"cache holds {cache.nbytes()} bytes, the formula says {want}")
    return {"T": T, "prefill_tokens_per_s": T / prefill_s, "decode_ms_per_token": 1e3 * steps[len(steps) // 2],
            "peak_rss_mb": vm_hwm_mb(), "model_rss_mb": model_rss, "cache_mb": cache.nbytes() / 2 ** 20}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--T", type=int, nargs="+", default=[1024, 4096, 16384, 65536])
    ap.add_argument("--chunk", type=int, default=2048, help="prefill chunk (tokens per forward)")
    ap.add_argument("--decode", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--one", type=int, help=argparse.SUPPRESS)  # internal: run one T, print JSON
    a = ap.parse_args()
    if a.one:
        print(json.dumps(run_one(a.preset, a.one, a.chunk, a.decode, a.threads)))
        return
    rows = []
    for T in a.T:
        cmd = [sys.executable, __file__, "--one", str(T), "--preset", a.preset, "--chunk", str(a.chunk),
               "--decode", str(a.decode), "--threads", str(a.threads)]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode:
            raise SystemExit(f"T={T} failed:\n{r.stderr}")
        rows.append(json.loads(r.stdout.strip().splitlines()[-1]))
        print(f"  T={T} done", file=sys.stderr, flush=True)
    config = f"{a.preset} chunk={a.chunk} decode={a.decode} threads={a.threads} fp32"
    print(f"long context, {config}")
    print(f"{'T':>8}{'prefill tok/s':>15}{'decode ms/tok':>15}{'cache MiB':>11}{'peak RSS MiB':>14}"
          f"{'model RSS MiB':>15}")
    for r in rows:
        print(f"{r['T']:>8}{r['prefill_tokens_per_s']:>15.0f}{r['decode_ms_per_token']:>15.2f}"
              f"{r['cache_mb']:>11.1f}{r['peak_rss_mb']:>14.0f}{r['model_rss_mb']:>15.0f}")
    RESULTS.parent.mkdir(exist_ok=True)
    base = rows[0]
    with open(RESULTS, "a") as f:
        for r in rows:
            for m in METRICS:
                f.write(json.dumps({"bench": "long_context", "config": f"{config} T={r['T']}", "metric": m,
                                    "value": r[m], "baseline": base[m], "ratio": r[m] / base[m]}) + "\n")


if __name__ == "__main__":
    main()
