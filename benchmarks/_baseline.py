"""``benchmarks/train.py --what baseline``: K3-tiny against a dense model of the same active size.

Both train on the same batches (a fresh StridedBatches over the Trainer's own token stream starts
where the Trainer's did), with the same tokenizer, steps, batch shape, WSD fractions, grad clip
and thread count; both are scored on the same first validation batches with the same formula as
Trainer.evaluate (Σ nats / ln 2 / UTF-8 bytes of the predicted tokens).
"""

from __future__ import annotations

import json
import math
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from _dense import DenseGPT, adamw_for, matching_width
from k3.data.batches import StridedBatches
from k3.data.packing import IGNORE_INDEX, eval_batches
from k3.model.summary import parameter_breakdown
from k3.cli.train import DEMO_CONFIG
from k3.train.config import TrainConfig
from k3.train.loop import Trainer


@torch.no_grad()
def bits_per_byte(logits_fn, val_tokens, token_bytes, batch: int, seq_len: int, max_batches: int) -> float:
    nats, nbytes = 0.0, 0
    for x, y in eval_batches(val_tokens, batch, seq_len, max_batches or None):
        logits = logits_fn(x)
        nats += F.cross_entropy(logits.flatten(0, 1).float(), y.flatten(), ignore_index=IGNORE_INDEX,
                                reduction="sum").item()
        nbytes += int(token_bytes[y[y != IGNORE_INDEX]].sum())
    return nats / math.log(2) / max(nbytes, 1)


def train_dense(tr: Trainer, steps: int, lr: float) -> tuple[DenseGPT, list[float], list[float]]:
    """(model, per-step seconds, losses) of the dense baseline on the K3 run's data and schedule."""
    tc = tr.tc
    seq = tc.curriculum[0][1]
    cfg = tr.model_config  # the same depth and head count as the K3 model, the width to match
    d = matching_width(parameter_breakdown(tr.model).activated, cfg.vocab_size, cfg.num_hidden_layers,
                       cfg.num_attention_heads)
    torch.manual_seed(tc.seed)
    model = DenseGPT(cfg.vocab_size, d, cfg.num_hidden_layers, cfg.num_attention_heads, seq)
    opt = adamw_for(model, lr)
    sched = tc.replace(lr=lr).lr_schedule()
    data = StridedBatches(tr.train_tokens, tc.batch_size, seq)
    times, losses = [], []
    model.train()
    for s in range(steps):
        x, y = data.next_batch(seq)
        t0 = time.perf_counter()
        for g in opt.param_groups:
            g["lr"] = sched.lr_at(s)
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten(), ignore_index=IGNORE_INDEX)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), tc.grad_clip)
        opt.step()
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
    model.eval()
    return model, times, losses


def baseline(args, results: Path) -> None:
    threads = torch.get_num_threads()
    with tempfile.TemporaryDirectory(prefix="k3-baseline-") as tmp:
        tc = TrainConfig.build(overrides={**DEMO_CONFIG, "out": tmp, "steps": args.baseline_steps,
                                          "data": args.data, "threads": threads, "eval_interval": 0,
                                          "ckpt_interval": 0, "final_eval_batches": 1, "plot": False})
        tr = Trainer(tc, tty=False, print_fn=lambda s: None)
        n_act = parameter_breakdown(tr.model).activated
        res = tr.train()
        recs = [r for r in tr.metrics.records if r["kind"] == "train"]
        k3_tps = statistics.median(r["tokens_per_s"] for r in recs[1:])
        seq = tc.curriculum[0][1]
        k3_bpb = bits_per_byte(lambda x: tr.model(x).logits, tr.val_tokens, tr.token_bytes,
                               tc.batch_size, seq, args.eval_batches)
        dense, times, losses = train_dense(tr, args.baseline_steps, args.dense_lr)
        dense_tps = tc.batch_size * seq / statistics.median(times[1:])
        dense_bpb = bits_per_byte(dense, tr.val_tokens, tr.token_bytes, tc.batch_size, seq, args.eval_batches)
        assert res.status == "done"
    d, L, H = dense.ln_f.weight.numel(), len(dense.blocks), dense.blocks[0].n_head
    cfg = (f"tiny vs dense d{d} L{L} H{H} (active {n_act:,} vs {dense.active_params():,}), B{tc.batch_size} "
           f"T{seq}, {args.baseline_steps} steps, threads={threads}, eval {args.eval_batches or 'all'} val batches")
    print(f"\n{cfg}")
    print(f"{'model':<8} {'tokens/s':>10} {'val bits/byte':>14} {'last loss':>10}")
    print(f"{'K3-tiny':<8} {k3_tps:>10,.0f} {k3_bpb:>14.3f} {recs[-1]['loss']:>10.3f}")
    print(f"{'dense':<8} {dense_tps:>10,.0f} {dense_bpb:>14.3f} {losses[-1]:>10.3f}")
    print(f"K3 / dense: tokens/s x{k3_tps / dense_tps:.3f}, bits/byte x{k3_bpb / dense_bpb:.3f}")
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S")
    with open(results, "a") as f:
        for metric, k3v, dv in (("tokens_per_s", k3_tps, dense_tps), ("val_bits_per_byte", k3_bpb, dense_bpb)):
            f.write(json.dumps({"bench": "train_baseline", "config": cfg, "metric": metric, "value": k3v,
                                "baseline": dv, "ratio": k3v / dv, "time": stamp}) + "\n")
