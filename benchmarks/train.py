"""Training throughput: MFU of a preset, and K3-tiny against a dense baseline of the same active size.

``--what mfu`` (the `small` preset by default; one training step = what Trainer.train_step runs):

Measured in one process: tokens/s of full optimizer steps (forward, cross-entropy, backward,
grad-norm clip, Per-Head Muon + AdamW step, Quantile-Balancing bias update) on random tokens, and
the peak matmul rate of the same device and thread count (a large square fp32 matmul), so

    MFU = model FLOPs per second / peak matmul FLOP/s        ("ratio" in the JSON line)

Model FLOPs per trained token (the usual 6·N rule plus attention, no recomputation counted):

    6 · N_act                                   N_act = activated parameters: all but the input
                                                embedding, routed experts counted k of E (lm_head in)
    + Σ_MLA layers  3 · 2 · nh · (d_qk + d_v) · (T + 1)/2      causal scores and values, avg context
    + Σ_KDA layers  3 · 7 · nh · d_k · d_v                     delta-rule recurrence per token:
                                                S^T k, rank-1 update, S^T q (2·d_k·d_v each) + decay

(the chunked KDA form does extra intra-chunk work that is not counted: MFU counts useful math).
Medians over the timed steps. Issue 15's row: ``--what mfu --batch-size 8 --seq-len 512``;
``--dtype bf16`` times the same step under bf16 autocast against the same fp32 peak.

``--what baseline``: the architecture's overhead. K3-tiny trains with the real Trainer (the demo's
recipe: B8 T256, Per-Head Muon + AdamW, WSD, QB) and a dense nanoGPT-style transformer
(benchmarks/_dense.py) with the same activated parameters per token trains with AdamW on exactly
the same batches of the same tokenizer, for the same steps, in the same process and thread count.
Printed: each model's median tokens/s and validation bits per byte (the first --eval-batches
validation batches), and K3 / dense as ratios. ``--steps`` longer for a converged comparison.

Appends JSON lines to benchmarks/results/train.jsonl.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

from k3.threads import configure_openmp

configure_openmp()  # as k3 train does, before torch loads libgomp (k3.threads)
import torch  # noqa: E402

from k3.config import get_preset
from k3.model.decoder import K3ForCausalLM
from k3.model.summary import parameter_breakdown
from k3.ops.loss import cross_entropy
from k3.model.stats import ForwardStats
from k3.train.balance import RouterBalancer
from k3.train.optim import build_optimizer

sys.path.insert(0, str(Path(__file__).parent))
from _timing import append_results  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "train.jsonl"


def model_flops_per_token(model: K3ForCausalLM, seq_len: int) -> dict[str, float]:
    cfg = model.config
    n_act = parameter_breakdown(model).activated
    nh, dqk, dv = cfg.num_attention_heads, cfg.qk_head_dim, cfg.v_head_dim
    mla = len(cfg.mla_layer_ids) * 3 * 2 * nh * (dqk + dv) * (seq_len + 1) / 2
    lac = cfg.linear_attn_config
    kda = len(cfg.kda_layer_ids) * 3 * 7 * lac.num_heads * lac.head_dim * lac.head_dim
    return {"dense": 6.0 * n_act, "mla": mla, "kda": kda, "total": 6.0 * n_act + mla + kda,
            "activated_params": n_act}


def peak_matmul_flops(device: torch.device, n: int, repeats: int) -> float:
    a = torch.randn(n, n, device=device)
    b = torch.randn(n, n, device=device)
    times = []
    for _ in range(repeats + 1):
        _sync(device)
        t0 = time.perf_counter()
        a @ b
        _sync(device)
        times.append(time.perf_counter() - t0)
    return 2 * n ** 3 / statistics.median(times[1:])


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def step_times(model, opt, bal, batch: int, seq_len: int, steps: int, warmup: int,
               device: torch.device, autocast: torch.dtype | None = None) -> list[float]:
    V = model.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    times = []
    for i in range(warmup + steps):
        x = torch.randint(0, V, (batch, seq_len + 1), generator=gen).to(device)
        _sync(device)
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=autocast or torch.bfloat16, enabled=autocast is not None):
            out = model(x[:, :-1], stats=ForwardStats())
            loss = cross_entropy(out.logits.flatten(0, 1), x[:, 1:].flatten())  # as Trainer._loss
        loss.backward()
        bal.collect(out.stats)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        bal.update()
        _sync(device)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--what", default="mfu,baseline", help="mfu, baseline or both (comma-separated)")
    ap.add_argument("--preset", default="small", help="--what mfu: the preset")
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--steps", type=int, default=3, help="--what mfu: timed steps")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--matmul-n", type=int, default=2048)
    ap.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"),
                    help="--what mfu: bf16 runs forward and loss under bf16 autocast (as k3 train --dtype bf16); "
                         "the peak stays the fp32 matmul rate, so MFU compares with the fp32 step")
    ap.add_argument("--baseline-steps", type=int, default=24, help="--what baseline: steps of each model")
    ap.add_argument("--eval-batches", type=int, default=8, help="--what baseline: validation batches (0: all)")
    ap.add_argument("--dense-lr", type=float, default=3e-3, help="--what baseline: the dense model's AdamW lr")
    ap.add_argument("--data", help="--what baseline: corpus (default: the Python stdlib)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.set_flush_denormal(True)
    what = set(args.what.split(","))
    if what - {"mfu", "baseline"}:
        ap.error(f"--what: unknown {sorted(what - {'mfu', 'baseline'})}; use mfu, baseline")
    if "mfu" in what:
        mfu(args)
    if "baseline" in what:
        from _baseline import baseline
        baseline(args, RESULTS)


def mfu(args) -> None:
    device = torch.device(args.device)
    torch.manual_seed(0)
    model = K3ForCausalLM(get_preset(args.preset)).to(device)
    opt = build_optimizer(model, model.config, 3e-3, 0.0)
    bal = RouterBalancer(model, "quantile")
    fl = model_flops_per_token(model, args.seq_len)
    peak = peak_matmul_flops(device, args.matmul_n, 5)
    autocast = torch.bfloat16 if args.dtype == "bf16" else None
    times = step_times(model, opt, bal, args.batch_size, args.seq_len, args.steps, args.warmup, device, autocast)
    peak = max(peak, peak_matmul_flops(device, args.matmul_n, 5))  # before and after: the better one
    step = statistics.median(times)
    tokens = args.batch_size * args.seq_len
    tps = tokens / step
    achieved = tps * fl["total"]
    cfg = (f"{args.preset} B{args.batch_size} T{args.seq_len} {device.type} "
           f"threads={torch.get_num_threads()}" + (" bf16-autocast" if autocast else ""))
    print(f"{'config':<40} {'tokens/s':>10} {'model TFLOP/s':>14} {'peak TFLOP/s':>13} {'MFU':>7}")
    print(f"{cfg:<40} {tps:>10,.0f} {achieved / 1e12:>14.4f} {peak / 1e12:>13.4f} {achieved / peak:>7.2%}")
    print(f"model FLOPs/token: 6·N_act {fl['dense']:.3g} (N_act {fl['activated_params']:,}) + "
          f"MLA {fl['mla']:.3g} + KDA {fl['kda']:.3g}; median step {step:.3f} s over {len(times)}")
    line = {"bench": "train", "config": cfg, "metric": "model_flops_per_s_vs_peak_matmul",
            "value": achieved, "baseline": peak, "ratio": achieved / peak, "tokens_per_s": tps,
            "model_flops_per_token": fl["total"], "activated_params": fl["activated_params"],
            "median_step_s": step, "steps": len(times), "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
    append_results(RESULTS, [line])


if __name__ == "__main__":
    main()
