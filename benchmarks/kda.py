"""KDA benchmark: chunk_kda vs recurrent_kda vs a naive per-token loop (SPEC §8).

B=1, H=4, D=64, fp32, 2 threads, T ∈ {1024, 4096, 16384}. Reports medians of repeated runs and
ratios against baselines measured in this process:
  - chunk fwd and chunk fwd+bwd against recurrent_kda (fwd, fwd+bwd) and the naive loop (fwd);
  - chunk fwd at T against chunk fwd at 4096 (scaling; the target is ≤ 4.5× for 4× the tokens).
The recurrent and naive baselines are linear in T with a constant per-token cost (one step per
token, state size independent of T), so they are timed once on the first --slice tokens and
extrapolated (×T/slice); the `config` of such rows says `extrapolated_from`.

Appends JSON lines {"bench","config","metric","value","baseline","ratio"} to
benchmarks/results/kda.jsonl. `--quick`: fewer repeats, T ∈ {1024, 4096}.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from _timing import median_time  # benchmarks/ is on sys.path when run as a script

from k3.ops.kda import chunk_kda, kda_gate, l2_normalize, recurrent_kda

RESULTS = Path(__file__).resolve().parent / "results" / "kda.jsonl"


def naive_kda(q, k, v, g, beta, scale=None, initial_state=None):
    """Per-token loop with einsums, straight from the SPEC formula (the reference baseline)."""
    B, T, H, K = q.shape
    scale = K ** -0.5 if scale is None else scale
    S = q.new_zeros(B, H, K, v.shape[-1]) if initial_state is None else initial_state
    o = []
    for t in range(T):
        S = torch.exp(g[:, t])[..., None] * S
        pred = torch.einsum("bhkv,bhk->bhv", S, k[:, t])
        S = S + torch.einsum("bhk,bhv->bhkv", beta[:, t, :, None] * k[:, t], v[:, t] - pred)
        o.append(torch.einsum("bhkv,bhk->bhv", S, scale * q[:, t]))
    return torch.stack(o, dim=1), S


def make_inputs(T, B=1, H=4, D=64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = l2_normalize(torch.randn(B, T, H, D, generator=gen))
    k = l2_normalize(torch.randn(B, T, H, D, generator=gen))
    v = torch.randn(B, T, H, D, generator=gen)
    g = kda_gate(torch.randn(B, T, H, D, generator=gen), torch.zeros(H), torch.zeros(H * D), -5.0)
    beta = torch.sigmoid(torch.randn(B, T, H, generator=gen))
    return q, k, v, g, beta


def k3_chunk(*inputs):
    """chunk_kda as the K3 layer calls it: the gates are bounded by lb = −5 (make_inputs)."""
    return chunk_kda(*inputs, g_lower_bound=-5.0)


def fwd(f, inputs):
    with torch.no_grad():
        f(*inputs)


def fwd_bwd(f, inputs):
    xs = [x.detach().requires_grad_(True) for x in inputs]
    o, _ = f(*xs)
    o.sum().backward()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer repeats, T up to 4096")
    ap.add_argument("--slice", type=int, default=256, help="tokens timed for the linear baselines")
    ap.add_argument("--threads", type=int, default=2,
                    help="intra-op threads (2 per SPEC; 1 is steadier on an oversubscribed machine)")
    args = ap.parse_args()
    torch.set_flush_denormal(True)  # an entry point: k3 no longer sets it on import
    torch.set_num_threads(args.threads)
    reps = 3 if args.quick else 5
    lengths = [1024, 4096] if args.quick else [1024, 4096, 16384]

    rows = []

    def record(config, metric, value, baseline, base_name):
        ratio = baseline / value
        rows.append({"bench": "kda", "config": config, "metric": metric, "value": value,
                     "baseline": baseline, "ratio": ratio})
        print(f"{config['T']:>6} {metric:<22} {value * 1e3:>10.1f} ms   {base_name:<26} "
              f"{baseline * 1e3:>10.1f} ms   {ratio:>7.2f}x")

    print(f"{'T':>6} {'metric':<22} {'median':>13}   {'baseline':<26} {'median':>13}   {'speedup':>8}")
    chunk_fwd_at = {}
    baseline_per_token: dict[str, float] = {}
    for T in lengths:
        inputs = make_inputs(T)
        n = min(T, args.slice)
        sliced = tuple(x[:, :n] for x in inputs)
        base = {"B": 1, "H": 4, "D": 64, "T": T, "dtype": "float32", "threads": args.threads}
        ext = dict(base, extrapolated_from=n) if n < T else base

        # The baselines cost the same per token at every T: measure them once, on the first slice.
        if not baseline_per_token:
            baseline_per_token["rf"] = median_time(lambda: fwd(recurrent_kda, sliced), 3) / n
            baseline_per_token["nf"] = median_time(lambda: fwd(naive_kda, sliced), 1) / n
            baseline_per_token["rfb"] = median_time(lambda: fwd_bwd(recurrent_kda, sliced), 1) / n
        r_f, n_f, r_fb = (baseline_per_token[key] * T for key in ("rf", "nf", "rfb"))
        c_f = median_time(lambda: fwd(k3_chunk, inputs), reps)
        c_fb = median_time(lambda: fwd_bwd(k3_chunk, inputs), reps)
        chunk_fwd_at[T] = c_f

        record(ext, "chunk_fwd", c_f, r_f, "recurrent_kda fwd")
        record(ext, "chunk_fwd", c_f, n_f, "naive loop fwd")
        record(ext, "chunk_fwd_bwd", c_fb, r_fb, "recurrent_kda fwd+bwd")
    if 4096 in chunk_fwd_at:
        for T, c_f in chunk_fwd_at.items():
            if T > 4096:
                cfg = {"B": 1, "H": 4, "D": 64, "T": T, "dtype": "float32", "threads": args.threads, "vs_T": 4096}
                r = c_f / chunk_fwd_at[4096]
                rows.append({"bench": "kda", "config": cfg, "metric": "chunk_fwd_scaling",
                             "value": c_f, "baseline": chunk_fwd_at[4096], "ratio": r})
                print(f"{T:>6} chunk_fwd time / time at T=4096: {r:.2f} (linear would be {T / 4096:.1f})")

    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    with RESULTS.open("a") as fh:
        for row in rows:
            fh.write(json.dumps(row) + "\n")
    print(f"appended {len(rows)} rows to {RESULTS}")


if __name__ == "__main__":
    main()
