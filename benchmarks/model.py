"""Model throughput: tokens/s of forward and forward+backward, and peak memory.

Cases (timed together in one process, their steps taken in turn; each case's peak RSS from a
subprocess of its own):
  * ``k3``          – the ``small`` preset (K3 mode: KDA+MLA, AttnRes, LatentMoE, SiTU).
  * ``k3-kl``       – ``small`` geometry in Kimi-Linear mode (SwiGLU, plain MoE, no AttnRes/gates).
  * ``transformers``– transformers' ``KimiLinearForCausalLM`` (pure-PyTorch fallback) on the same
                      Kimi-Linear-mode config — the baseline: ratios are k3-kl / transformers, i.e.
                      the same math in both implementations.

Issue 15's row: ``--preset tiny --batch 4 --seq 512 --threads 2`` (8 layers, d 256, 16 experts
top-4). Prints a table and appends JSON lines to benchmarks/results/model.jsonl (stamped with the machine, date
and commit by ``_timing.append_results``; each row also names its preset, batch, seq, threads, case and the
case's parameter count). Each timing is the median
of at least --repeats runs that together last at least --min-seconds, taken in rounds in which each case
runs for about one step of the slowest (see run_interleaved): this machine's speed moves by 20-30 % (at
times 2x) within minutes, and measured one case after the other, a slow phase falls on one side of a
ratio only.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

from _timing import append_results  # benchmarks/ is on sys.path when run as a script

RESULTS = Path(__file__).parent / "results" / "model.jsonl"


def kimi_linear_mode(cfg):
    return cfg.replace(hidden_act="silu", activation_situ_linear_beta=None, routed_expert_hidden_size=None,
                       latent_moe_use_norm=False, attn_res_block_size=None, mla_use_output_gate=False,
                       linear_attn_config={**cfg.linear_attn_config.to_dict(), "gate_lower_bound": None,
                                           "use_full_rank_gate": False},
                       mla_latent_norm_eps=1e-6)


def transformers_model(cfg):
    from transformers import KimiLinearConfig, KimiLinearForCausalLM

    n = cfg.num_hidden_layers
    hf = KimiLinearConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        moe_intermediate_size=cfg.moe_intermediate_size, num_hidden_layers=n,
        num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.num_attention_heads,
        kv_lora_rank=cfg.kv_lora_rank, q_lora_rank=cfg.q_lora_rank, qk_rope_head_dim=cfg.qk_rope_head_dim,
        qk_nope_head_dim=cfg.qk_nope_head_dim, v_head_dim=cfg.v_head_dim, num_local_experts=cfg.num_experts,
        num_experts_per_tok=cfg.num_experts_per_token, n_shared_experts=cfg.num_shared_experts,
        linear_head_dim=cfg.linear_attn_config.head_dim, linear_num_heads=cfg.linear_attn_config.num_heads,
        layer_types=["linear_attention" if cfg.is_kda_layer(l) else "full_attention" for l in range(n)],
        mlp_layer_types=["dense" if l < cfg.first_k_dense_replace else "sparse" for l in range(n)],
        routed_scaling_factor=cfg.routed_scaling_factor, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return KimiLinearForCausalLM(hf)


CASES = ("k3", "k3-kl", "transformers")
STEPS = ("forward", "forward_backward")


def _case_steps(case: str, preset: str, batch: int, seq: int):
    """(model, {step name: callable}) of one case; torch is set up by the caller."""
    import torch

    from k3.config import get_preset
    from k3.model.decoder import K3ForCausalLM

    torch.manual_seed(0)
    cfg = get_preset(preset)
    if case == "k3":
        model = K3ForCausalLM(cfg)
    elif case == "k3-kl":
        model = K3ForCausalLM(kimi_linear_mode(cfg))
    else:
        model = transformers_model(kimi_linear_mode(cfg))
    ids = torch.randint(3, cfg.vocab_size, (batch, seq))

    def fwd():
        with torch.no_grad():
            model(ids)

    def fwd_bwd():
        model(ids, labels=ids).loss.backward()

    return model, {"forward": fwd, "forward_backward": fwd_bwd}


def _setup_torch(threads: int):
    from k3.threads import configure_openmp

    configure_openmp()  # before torch loads libgomp (each run is its own process): no spin collapse
    import torch

    torch.set_num_threads(threads)
    torch.set_flush_denormal(True)
    return torch


def run_case(case: str, preset: str, batch: int, seq: int, threads: int) -> dict:
    """One case alone in its process, for its peak RSS: one run of each step."""
    _setup_torch(threads)
    model, steps = _case_steps(case, preset, batch, seq)
    for fn in steps.values():
        fn()
    return {"peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "params": sum(p.numel() for p in model.parameters())}


def run_interleaved(preset: str, batch: int, seq: int, repeats: int, threads: int, min_seconds: float) -> dict:
    """Every case's tokens/s, the three models in one process and timed in rounds: in each round every
    case runs its step for about as long as the slowest case's one step takes (a 13 s transformers
    step: about 13 K3 steps), until each case has at least ``repeats`` runs lasting at least
    ``min_seconds`` in all. So every case is sampled over the same stretches of time, and a change in
    the machine's speed during the run reaches all of them alike. Medians per case."""
    _setup_torch(threads)
    steps = {case: _case_steps(case, preset, batch, seq)[1] for case in CASES}
    out = {case: {} for case in CASES}
    for name in STEPS:
        times = {case: [] for case in CASES}
        warm = {}
        for case in CASES:
            t0 = time.perf_counter()
            steps[case][name]()  # warm-up
            warm[case] = time.perf_counter() - t0
        while any(len(t) < repeats or sum(t) < min_seconds for t in times.values()):
            slice_s = max(t[-1] if t else warm[case] for case, t in times.items())
            for case in CASES:
                t, spent = times[case], 0.0
                while spent < 0.9 * slice_s or not spent:
                    t0 = time.perf_counter()
                    steps[case][name]()
                    t.append(time.perf_counter() - t0)
                    spent += t[-1]
        for case in CASES:
            out[case][name] = batch * seq / statistics.median(times[case])
            out[case][f"{name}_runs"] = len(times[case])
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="small")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--min-seconds", type=float, default=20.0,
                    help="each case's timed runs of a step add up to at least this many seconds (and --repeats)")
    ap.add_argument("--case", help=argparse.SUPPRESS)  # internal: one case's RSS, or "interleaved"
    a = ap.parse_args()
    if a.case:
        if a.case == "interleaved":
            r = run_interleaved(a.preset, a.batch, a.seq, a.repeats, a.threads, a.min_seconds)
        else:
            r = run_case(a.case, a.preset, a.batch, a.seq, a.threads)
        print(json.dumps(r))
        return

    def sub(case: str) -> dict:
        cmd = [sys.executable, __file__, "--case", case, "--preset", a.preset, "--batch", str(a.batch),
               "--seq", str(a.seq), "--repeats", str(a.repeats), "--threads", str(a.threads),
               "--min-seconds", str(a.min_seconds)]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode:
            raise SystemExit(f"case {case} failed:\n{r.stderr}")
        return json.loads(r.stdout.strip().splitlines()[-1])

    res = sub("interleaved")
    for case in CASES:
        res[case].update(sub(case))
    base = res["transformers"]
    config = f"{a.preset} B={a.batch} T={a.seq} threads={a.threads}"
    print(f"model throughput, {config} (tokens/s: medians of >= {a.repeats} runs over >= {a.min_seconds:g} s per "
          "case, the cases timed in turn in one process); baseline = transformers kimi_linear")
    print(f"{'case':<14}{'params':>12}{'fwd tok/s':>12}{'fwd+bwd tok/s':>15}{'peak RSS MB':>13}{'fwd ratio':>11}"
          f"{'f+b ratio':>11}")
    rows = []
    for case, r in res.items():
        rf, rb = r["forward"] / base["forward"], r["forward_backward"] / base["forward_backward"]
        print(f"{case:<14}{r['params']:>12,}{r['forward']:>12.0f}{r['forward_backward']:>15.0f}"
              f"{r['peak_rss_mb']:>13.0f}{rf:>11.2f}{rb:>11.2f}")
        fields = {"preset": a.preset, "batch": a.batch, "seq": a.seq, "threads": a.threads, "case": case,
                  "params": r["params"], "baseline_name": "transformers kimi_linear"}
        for metric in STEPS:
            rows.append({"bench": "model", "config": f"{config} case={case}",
                         "metric": f"{metric}_tokens_per_s", "value": r[metric],
                         "baseline": base[metric], "ratio": r[metric] / base[metric],
                         "runs": r[f"{metric}_runs"], "baseline_runs": base[f"{metric}_runs"],
                         "interleaved": True, **fields})
        rows.append({"bench": "model", "config": f"{config} case={case}", "metric": "peak_rss_mb",
                     "value": r["peak_rss_mb"], "baseline": base["peak_rss_mb"],
                     "ratio": r["peak_rss_mb"] / base["peak_rss_mb"], **fields})
    append_results(RESULTS, rows)


if __name__ == "__main__":
    main()
