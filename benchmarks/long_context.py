"""Long context on the ``tiny`` preset: chunked prefill of a T-token prompt, then 16 decode steps.

For each T (default 1024, 4096, 16384, 65536) a fresh subprocess builds the model (random init,
fp32, ``max_position_embeddings`` raised to fit T: K3 is NoPE, so nothing else depends on it) and
measures it with ``k3 eval accept``'s function (``k3.rl.longctx.accept``): prefill through a
``K3Cache`` in chunks of ``--chunk`` tokens (chunk KDA, query-chunked MLA over the cached
latents), then 16 greedy decode steps (recurrent KDA, absorbed MLA). It reports prefill tokens/s,
decode ms/token (the mean step), the cache bytes after prefill (checked against the cache
formula) and the peak RSS over that T's prefill and decode (``VmHWM`` after a reset;
``model_rss_mb`` is VmHWM right after building the model, before any token).

Prints a table and appends JSON lines (SPEC §8) to benchmarks/results/long_context.jsonl; the
baseline of each metric is its value at the smallest T (ratio = growth with context).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
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
    """One T in this process, measured by ``k3 eval accept``'s own function (``k3.rl.longctx.accept``);
    the cache it reports is checked against the model's cache formula."""
    import torch

    from k3.config import get_preset
    from k3.model.cache import cache_bytes_per_sequence
    from k3.model.decoder import K3ForCausalLM
    from k3.rl.longctx import accept

    torch.set_num_threads(threads)
    torch.set_flush_denormal(True)
    torch.manual_seed(0)
    cfg = get_preset(preset)
    cfg = cfg.replace(max_position_embeddings=max(cfg.max_position_embeddings, T + decode))
    model = K3ForCausalLM(cfg).eval()
    model_rss = vm_hwm_mb()
    (r,) = accept(model, [T], decode_tokens=decode, prefill_chunk=chunk)
    if not r["ok"]:
        raise RuntimeError(f"T={T}: {r['error']}")
    want = cache_bytes_per_sequence(cfg, T, torch.float32)["total"]
    if r["cache_bytes"] != want:
        raise RuntimeError(f"cache holds {r['cache_bytes']} bytes after prefill, the formula says {want}")
    return {"T": T, "prefill_tokens_per_s": 1 / r["prefill_s_per_token"], "decode_ms_per_token": 1e3 * r["decode_s_per_token"],
            "peak_rss_mb": (r["peak_rss_bytes"] or 0) / 2 ** 20, "model_rss_mb": model_rss,
            "cache_mb": r["cache_bytes"] / 2 ** 20}


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
