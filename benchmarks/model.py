"""Model throughput: tokens/s of forward and forward+backward, and peak memory.

Cases (each run in its own subprocess so peak RSS is that case's own):
  * ``k3``          – the ``small`` preset (K3 mode: KDA+MLA, AttnRes, LatentMoE, SiTU).
  * ``k3-kl``       – ``small`` geometry in Kimi-Linear mode (SwiGLU, plain MoE, no AttnRes/gates).
  * ``transformers``– transformers' ``KimiLinearForCausalLM`` (pure-PyTorch fallback) on the same
                      Kimi-Linear-mode config — the baseline: ratios are k3-kl / transformers, i.e.
                      the same math in both implementations.

Issue 15's row: ``--preset tiny --batch 4 --seq 512 --threads 2`` (8 layers, d 256, 16 experts
top-4). Prints a table and appends JSON lines to benchmarks/results/model.jsonl. Each timing is the median
of at least --repeats runs that together last at least --min-seconds: a 1-second K3 step and a 13-second
transformers step are then both sampled over tens of seconds, so a burst of load from outside the run
moves neither median much (this machine's speed moves by 20-30 % within a minute).
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


def run_case(case: str, preset: str, batch: int, seq: int, repeats: int, threads: int,
             min_seconds: float = 0.0) -> dict:
    from k3.threads import configure_openmp

    configure_openmp()  # before torch loads libgomp (each case is its own process): no spin collapse
    import torch

    from k3.config import get_preset
    from k3.model.decoder import K3ForCausalLM

    torch.set_num_threads(threads)
    torch.set_flush_denormal(True)
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

    out = {}
    for name, fn in (("forward", fwd), ("forward_backward", fwd_bwd)):
        fn()  # warm-up
        times = []
        while len(times) < repeats or sum(times) < min_seconds:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        out[name] = batch * seq / statistics.median(times)
        out[f"{name}_runs"] = len(times)
    out["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    out["params"] = sum(p.numel() for p in model.parameters())
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="small")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--min-seconds", type=float, default=20.0,
                    help="each timing repeats until its runs add up to this many seconds (and --repeats)")
    ap.add_argument("--case", help=argparse.SUPPRESS)  # internal: run one case and print JSON
    a = ap.parse_args()
    if a.case:
        print(json.dumps(run_case(a.case, a.preset, a.batch, a.seq, a.repeats, a.threads, a.min_seconds)))
        return
    res = {}
    for case in ("k3", "k3-kl", "transformers"):
        cmd = [sys.executable, __file__, "--case", case, "--preset", a.preset, "--batch", str(a.batch),
               "--seq", str(a.seq), "--repeats", str(a.repeats), "--threads", str(a.threads),
               "--min-seconds", str(a.min_seconds)]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode:
            raise SystemExit(f"case {case} failed:\n{r.stderr}")
        res[case] = json.loads(r.stdout.strip().splitlines()[-1])
    base = res["transformers"]
    config = f"{a.preset} B={a.batch} T={a.seq} threads={a.threads}"
    print(f"model throughput, {config} (tokens/s, median of >= {a.repeats} runs over >= {a.min_seconds:g} s); "
          "baseline = transformers kimi_linear")
    print(f"{'case':<14}{'params':>12}{'fwd tok/s':>12}{'fwd+bwd tok/s':>15}{'peak RSS MB':>13}{'fwd ratio':>11}"
          f"{'f+b ratio':>11}")
    RESULTS.parent.mkdir(exist_ok=True)
    with open(RESULTS, "a") as f:
        for case, r in res.items():
            rf, rb = r["forward"] / base["forward"], r["forward_backward"] / base["forward_backward"]
            print(f"{case:<14}{r['params']:>12,}{r['forward']:>12.0f}{r['forward_backward']:>15.0f}"
                  f"{r['peak_rss_mb']:>13.0f}{rf:>11.2f}{rb:>11.2f}")
            for metric in ("forward", "forward_backward"):
                f.write(json.dumps({"bench": "model", "config": f"{config} case={case}",
                                    "metric": f"{metric}_tokens_per_s", "value": r[metric],
                                    "baseline": base[metric], "ratio": r[metric] / base[metric],
                                    "runs": r[f"{metric}_runs"], "baseline_runs": base[f"{metric}_runs"]}) + "\n")
            f.write(json.dumps({"bench": "model", "config": f"{config} case={case}", "metric": "peak_rss_mb",
                                "value": r["peak_rss_mb"], "baseline": base["peak_rss_mb"],
                                "ratio": r["peak_rss_mb"] / base["peak_rss_mb"]}) + "\n")


if __name__ == "__main__":
    main()
