"""The demo recipe sweep (issue 15): candidate K3 recipes as data, ranked by training tokens/s and
by what they learn at a fixed token budget, through the real Trainer / TrainConfig.

Every candidate keeps all of K3's architecture on (KDA + MLA hybrid with the presets' layout rule
``k3_layer_split``: MLA every 4th layer and at the last; Block AttnRes; LatentMoE with Quantile
Balancing; SiTU; Per-Head Muon); only sizes, batch shape, schedule and dtype differ. A recipe is a
set of TrainConfig fields on top of BASE (the k3 demo recipe before this sweep: tiny, 8 layers,
B8 T256, lr 5e-3) plus ``model_overrides`` on the tiny preset; ``demo`` is BASE itself (the
baseline of every ratio), ``k3demo`` is whatever ``k3.cli.train.DEMO_CONFIG`` is now, and
``k3demo_*`` (DEMO_VARIANTS) change a few fields of it.

    python benchmarks/recipe.py --probe [--names a,b] [--threads 2] [--rounds 5] [--steps 2]
        tokens/s of each candidate's full training step (fwd + CE + bwd + clip + Per-Head Muon + QB),
        every candidate built once in this process and timed back to back for several rounds;
        medians, and the ratio to ``demo`` (the current k3 demo recipe) measured in the same run.
    python benchmarks/recipe.py --train a,b --tokens 200000 [--threads 1] [--eval-tokens 65536]
        a real training run per name (sequentially, in this process) for about N training tokens,
        with the recipe's own lr schedule stretched over those steps, scored on the first
        --eval-tokens validation tokens (0: the whole split) in windows of the recipe's longest
        sequence length (what k3 demo reports); bpb ratio vs ``demo`` when it is in the run.

Quality per training token is deterministic at a fixed thread count (it does not depend on machine
load); tokens/s does, which is why only ratios from one --probe run are comparable. Both modes
append JSON lines to benchmarks/results/recipe.jsonl.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import append_results  # noqa: E402
from scaling import k3_shape  # noqa: E402  (the demo's shape at a width, as the scaling sweep scales it)

RESULTS = Path(__file__).parent / "results" / "recipe.jsonl"


def kda_layout(layers: int, heads: int = 4, head_dim: int = 64) -> dict:
    """The tiny preset's linear_attn_config for ``layers`` layers (KDA/MLA split of the presets)."""
    from k3.config import k3_layer_split
    from k3.config.presets import tiny
    kda, full = k3_layer_split(layers)
    d = tiny().linear_attn_config.to_dict()
    d.update(kda_layers=kda, full_attn_layers=full, num_heads=heads, head_dim=head_dim)
    return d


def _shape(layers: int = 8, heads: int = 4, head_dim: int = 64, **model) -> dict:
    """model_overrides for a tiny-derived shape (AttnRes blocks of half the depth at < 8 layers)."""
    out = {"num_hidden_layers": layers, "linear_attn_config": kda_layout(layers, heads, head_dim)}
    if layers < 8:
        out["attn_res_block_size"] = max(1, layers // 2)
    out.update(model)
    return out


# k3 demo's recipe before the sweep (src/k3/train/commands.py at 654b6ed), minus its cadence
BASE: dict = {"preset": "tiny", "batch_size": 8, "curriculum": [[0, 256]], "lr": 5e-3, "warmup_frac": 0.1,
              "decay_frac": 0.4}

# name -> (TrainConfig fields over BASE, model_overrides on tiny). "demo" = BASE.
RECIPES: dict[str, tuple[dict, dict]] = {
    "demo": ({}, {}),
    "k3demo": (None, None),  # filled from k3.cli.train.DEMO_CONFIG in _recipe
    "demo_bf16": ({"dtype": "bf16"}, {}),
    "b16": ({"batch_size": 16}, {}),
    "b32": ({"batch_size": 32}, {}),
    "b16_bf16": ({"batch_size": 16, "dtype": "bf16"}, {}),
    "t512_b4": ({"batch_size": 4, "curriculum": [[0, 512]]}, {}),
    "l4": ({}, _shape(4)),
    "l4_b16": ({"batch_size": 16}, _shape(4)),
    "l4_b16_bf16": ({"batch_size": 16, "dtype": "bf16"}, _shape(4)),
    "l4_b16_lr1e2": ({"batch_size": 16, "lr": 1e-2}, _shape(4)),
    "l4_b16_lr3e3": ({"batch_size": 16, "lr": 3e-3}, _shape(4)),
    "l4_b16_decay7": ({"batch_size": 16, "decay_frac": 0.7}, _shape(4)),
    "l4_b32": ({"batch_size": 32}, _shape(4)),
    "l4_t512_b8": ({"batch_size": 8, "curriculum": [[0, 512]]}, _shape(4)),
    "l4_t512_b8_decay7": ({"batch_size": 8, "curriculum": [[0, 512]], "decay_frac": 0.7}, _shape(4)),
    "l4_b32_bf16": ({"batch_size": 32, "dtype": "bf16"}, _shape(4)),
    "l6_b16": ({"batch_size": 16}, _shape(6)),
    "l4_h2": ({"batch_size": 16}, _shape(4, heads=2, head_dim=128, num_attention_heads=2)),
    "l4_e8k2": ({"batch_size": 16}, _shape(4, num_experts=8, num_experts_per_token=2)),
    "l8_e8k2": ({"batch_size": 16}, _shape(8, num_experts=8, num_experts_per_token=2)),
    "l4_d384": ({"batch_size": 16}, _shape(4, hidden_size=384, intermediate_size=1152,
                                           moe_intermediate_size=192, routed_expert_hidden_size=192)),
    "l4_d384_e8k2": ({"batch_size": 16}, _shape(4, hidden_size=384, intermediate_size=1152,
                                                moe_intermediate_size=192, routed_expert_hidden_size=192,
                                                num_experts=8, num_experts_per_token=2)),
}

# The live k3 demo recipe and variants of it: name -> (TrainConfig fields, model_overrides) on top of it.
DEMO_VARIANTS: dict[str, tuple[dict, dict]] = {
    "k3demo": ({}, {}),
    "k3demo_bf16": ({"dtype": "bf16"}, {}),
    "k3demo_b8": ({"batch_size": 8}, {}),
    "k3demo_b32": ({"batch_size": 32}, {}),
    "k3demo_lr8e3": ({"lr": 8e-3}, {}),
    "k3demo_decay9": ({"warmup_frac": 0.05, "decay_frac": 0.95}, {}),
    "k3demo_wd": ({"weight_decay": 0.1}, {}),
    "k3demo_l3": ({}, {"num_hidden_layers": 3, "attn_res_block_size": 2,
                       "linear_attn_config": kda_layout(3)}),
    "k3demo_l2": ({}, {"num_hidden_layers": 2, "attn_res_block_size": 1,
                       "linear_attn_config": kda_layout(2)}),
    "k3demo_l3_b32": ({"batch_size": 32}, {"num_hidden_layers": 3, "attn_res_block_size": 2,
                                           "linear_attn_config": kda_layout(3)}),
    # issue 36 (the live recipe is now width 128, lr 1e-2): its neighbours in the scaling sweep's widths
    # (benchmarks/scaling.py k3_shape) and lr scan, at the demo's budget
    "k3demo_lr5e3": ({"lr": 5e-3}, {}),
    "k3demo_d192": ({}, k3_shape(192)),
    "k3demo_d256": ({}, k3_shape(256)),   # the width of the demo before issue 36
}
RECIPES.update({name: (None, None) for name in DEMO_VARIANTS})


def train_config(name: str, steps: int, threads: int, out: str, **extra):
    """The TrainConfig of recipe ``name`` (BASE < recipe < run settings)."""
    from k3.train.config import TrainConfig
    train, model = _recipe(name)
    over = {**BASE, **train, "model_overrides": model, "steps": steps, "threads": threads, "out": out, "plot": False, "ckpt_interval": 0,
            "eval_interval": 0, **extra}
    return TrainConfig.build(overrides=over)


def _recipe(name: str) -> tuple[dict, dict]:
    """(TrainConfig fields, model_overrides) of ``name``; ``k3demo`` reads k3 demo's live config."""
    if name not in DEMO_VARIANTS:
        return RECIPES[name]
    from k3.cli.train import DEMO_CONFIG
    train = {k: v for k, v in DEMO_CONFIG.items() if k not in ("model_overrides", "eval_interval",
             "eval_batches", "final_eval_batches", "ckpt_interval", "log_interval")}
    model = DEMO_CONFIG.get("model_overrides", {})
    more_train, more_model = DEMO_VARIANTS[name]
    return {**train, **more_train}, {**model, **more_model}


def steps_for_tokens(name: str, tokens: int) -> int:
    """The fewest steps whose curriculum covers ``tokens`` training tokens."""
    for steps in range(1, 100_000):
        tc = train_config(name, steps, 1, "/nonexistent")
        cur = tc.context_curriculum()
        if sum(tc.batch_size * tc.grad_accum * cur.seq_len_at(s) for s in range(steps)) >= tokens:
            return steps
    raise ValueError(f"{name}: {tokens} tokens need more than 100,000 steps")


def _trainer(tc):
    from k3.train.loop import Trainer
    return Trainer(tc, print_fn=lambda s: None, tty=False)


def _load() -> float:
    return os.getloadavg()[0]


def probe(names: list[str], threads: int, rounds: int, steps: int) -> list[dict]:
    """Median tokens/s of each candidate's training step, interleaved over ``rounds``."""
    tmp = tempfile.TemporaryDirectory(prefix="k3_recipe_")
    trainers = {}
    for n in names:
        trainers[n] = _trainer(train_config(n, 10_000, threads, f"{tmp.name}/{n}"))
        trainers[n].train_step()  # warm-up (allocator, first-call set-up)
    rates: dict[str, list[float]] = {n: [] for n in names}
    load0 = _load()
    for _ in range(rounds):
        for n, tr in trainers.items():
            toks, t0 = 0, time.perf_counter()
            for _ in range(steps):
                rec = tr.train_step()
                toks += tr.tc.batch_size * rec["seq_len"] * tr.tc.grad_accum
            rates[n].append(toks / (time.perf_counter() - t0))
    for tr in trainers.values():
        tr.close()
    tmp.cleanup()
    base = statistics.median(rates["demo"]) if "demo" in rates else None
    rows = []
    for n in names:
        med = statistics.median(rates[n])
        params = sum(p.numel() for p in trainers[n].model.parameters())
        rows.append({"bench": "recipe_probe", "name": n, "threads": threads, "tokens_per_s": med,
                     "ratio_vs_demo": med / base if base else None, "params": params,
                     "rounds": rounds, "steps_per_round": steps, "load": [load0, _load()],
                     "recipe": dict(zip(("train", "model"), _recipe(n)))})
    print(f"{'name':14s} {'params':>10s} {'tok/s':>8s} {'x demo':>7s}   (threads {threads}, "
          f"load {load0:.2f} -> {_load():.2f})")
    for r in rows:
        ratio = f"{r['ratio_vs_demo']:.2f}" if r["ratio_vs_demo"] else "-"
        print(f"{r['name']:14s} {r['params']:>10,d} {r['tokens_per_s']:>8.0f} {ratio:>7s}")
    return rows


def score(trainer, eval_tokens: int) -> dict:
    """nats/token and bits/byte over the first ``eval_tokens`` validation tokens (0: all), in
    windows of the recipe's longest sequence length (as ``k3 demo``'s final evaluation), batches
    of 8 windows."""
    import torch

    from k3.data.packing import IGNORE_INDEX, eval_batches
    val = trainer.val_tokens if not eval_tokens else trainer.val_tokens[:eval_tokens + 1]
    nats, ntok, nbytes = 0.0, 0, 0
    trainer.model.eval()
    with torch.no_grad():
        for x, y in eval_batches(val, 8, trainer.tc.max_seq_len):
            nats += trainer._loss(x, y, reduction="sum").item()
            keep = y[y != IGNORE_INDEX]
            ntok += keep.numel()
            nbytes += int(trainer.token_bytes[keep].sum())
    return {"val_loss": nats / ntok, "val_bpb": nats / math.log(2) / nbytes, "val_tokens": ntok}


def train(names: list[str], tokens: int, threads: int, eval_tokens: int, extra: dict) -> list[dict]:
    """One real training run per recipe at ~``tokens`` training tokens, scored alike."""
    tmp = tempfile.TemporaryDirectory(prefix="k3_recipe_")
    rows = []
    for n in names:
        steps = steps_for_tokens(n, tokens)
        tc = train_config(n, steps, threads, f"{tmp.name}/{n}", final_eval_batches=1, **extra)
        load0, t0 = _load(), time.perf_counter()
        tr = _trainer(tc)
        tr.train()
        wall = time.perf_counter() - t0
        recs = [r for r in tr.metrics.records if r["kind"] == "train"]
        t1 = time.perf_counter()
        sc = score(tr, eval_tokens)
        rows.append({"bench": "recipe_train", "name": n, "threads": threads, "steps": steps,
                     "tokens": tr.tokens_seen, "train_s": wall, "eval_s": time.perf_counter() - t1,
                     "tokens_per_s": tr.tokens_seen / sum(r["tokens"] / r["tokens_per_s"] for r in _per_step(recs)),
                     "final_loss": statistics.mean(r["loss"] for r in recs[-max(1, len(recs) // 10):]),
                     "eval_tokens": sc["val_tokens"], "val_loss": sc["val_loss"], "val_bpb": sc["val_bpb"],
                     "load": [load0, _load()], "extra": extra,
                     "recipe": dict(zip(("train", "model"), _recipe(n)))})
        print(f"{n}: {steps} steps, {tr.tokens_seen:,} tokens, {wall:.0f} s "
              f"({rows[-1]['tokens_per_s']:.0f} tok/s), val bpb {sc['val_bpb']:.4f} on "
              f"{sc['val_tokens']:,} tokens, load {load0:.2f} -> {_load():.2f}", flush=True)
    tmp.cleanup()
    base = next((r["val_bpb"] for r in rows if r["name"] == "demo"), None)
    print(f"\n{'name':14s} {'tokens':>9s} {'bpb':>7s} {'x demo':>7s} {'tok/s':>7s}")
    for r in rows:
        r["bpb_ratio_vs_demo"] = r["val_bpb"] / base if base else None
        ratio = f"{r['bpb_ratio_vs_demo']:.3f}" if base else "-"
        print(f"{r['name']:14s} {r['tokens']:>9,d} {r['val_bpb']:>7.4f} {ratio:>7s} {r['tokens_per_s']:>7.0f}")
    return rows


def _per_step(recs: list[dict]) -> list[dict]:
    """Per-step token counts from the cumulative ``tokens`` field of the train records."""
    out, prev = [], 0
    for r in recs:
        out.append({"tokens": r["tokens"] - prev, "tokens_per_s": r["tokens_per_s"]})
        prev = r["tokens"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--probe", action="store_true")
    ap.add_argument("--names", default=",".join(RECIPES), help="recipes for --probe")
    ap.add_argument("--train", help="comma-separated recipes to train")
    ap.add_argument("--tokens", type=int, default=200_000)
    ap.add_argument("--eval-tokens", type=int, default=65_536)
    ap.add_argument("--lr", type=float, help="override the recipes' peak lr (--train)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=2, help="steps per candidate per round (--probe)")
    a = ap.parse_args()
    unknown = [n for n in (a.train or a.names).split(",") if n not in RECIPES]
    if unknown:
        ap.error(f"unknown recipe(s) {unknown}; known: {', '.join(RECIPES)}")
    if a.probe == bool(a.train):
        ap.error("pass exactly one of --probe or --train")
    if a.probe:
        names = a.names.split(",")
        if "demo" not in names:
            names.insert(0, "demo")
        rows = probe(names, a.threads, a.rounds, a.steps)
    else:
        extra = {"lr": a.lr} if a.lr else {}
        rows = train(a.train.split(","), a.tokens, a.threads, a.eval_tokens, extra)
    append_results(RESULTS, rows)


if __name__ == "__main__":
    main()
