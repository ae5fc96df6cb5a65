"""Where a training step spends its time: torch.profiler over full optimizer steps, by op family.

One step = what Trainer.train_step runs (forward, cross-entropy, backward, grad-norm clip, Per-Head
Muon + AdamW, Quantile-Balancing update) on random tokens. Each op's *self* CPU time goes to the
innermost k3 scope it ran in — scopes are record_function ranges this script puts around the
model's parts (forward hooks and wrapped functions; the model code is not changed) — and a backward
op goes to the scope of the forward op that created its autograd node (profiler sequence numbers).
Ops outside every scope are split by kind (matmul, copies/allocation, other).

    python benchmarks/profile_train.py --preset tiny --batch-size 8 --seq-len 256 --threads 1

prints markdown tables (families with % of step time, forward / backward split, call counts; the
top ops by self time) for docs/TRAINING_SPEED.md. Appends one JSON line per family to
benchmarks/results/profile_train.jsonl.
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import time
from pathlib import Path

from k3.threads import configure_openmp

configure_openmp()
import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile, record_function  # noqa: E402

import k3.model.decoder as decoder  # noqa: E402
import k3.model.kda as kda  # noqa: E402
import k3.model.moe as moe  # noqa: E402
import k3.model.norm as norm  # noqa: E402
from k3.ops.loss import cross_entropy  # noqa: E402
import k3.train.optim as optim  # noqa: E402
from k3.config import get_preset  # noqa: E402
from k3.model.stats import ForwardStats  # noqa: E402
from k3.train.balance import RouterBalancer  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "profile_train.jsonl"
P = "k3::"
MATMUL = {"aten::mm", "aten::bmm", "aten::addmm", "aten::matmul", "aten::linear", "aten::baddbmm",
          "aten::_grouped_mm", "aten::linalg_solve_triangular", "aten::_scaled_dot_product_flash_attention_for_cpu"}
COPY = {"aten::copy_", "aten::empty", "aten::empty_strided", "aten::zeros", "aten::zero_", "aten::fill_",
        "aten::clone", "aten::contiguous", "aten::cat", "aten::stack", "aten::_to_copy", "aten::to",
        "aten::index_select", "aten::index", "aten::index_add_", "aten::gather", "aten::scatter_add_",
        "aten::new_zeros", "aten::new_empty", "aten::resize_", "aten::pad", "aten::constant_pad_nd"}


def scoped(name: str, fn):
    @functools.wraps(fn)
    def run(*a, **k):
        with record_function(P + name):
            return fn(*a, **k)
    return run


def instrument(model, opt) -> None:
    """record_function scopes around the model's parts (innermost wins when they nest)."""
    kda.chunk_kda = scoped("KDA chunk (chunk_kda)", kda.chunk_kda)
    decoder.attn_res_mix = scoped("AttnRes mixing", decoder.attn_res_mix)
    moe.route_topk = scoped("MoE routing (route_topk)", moe.route_topk)
    moe.grouped_linear = scoped("MoE experts (grouped_mm)", moe.grouped_linear)
    norm.rms_norm = scoped("RMSNorm", norm.rms_norm)
    optim.zeropower_via_newtonschulz5 = scoped("Muon Newton-Schulz", optim.zeropower_via_newtonschulz5)
    opt.step = scoped("optimizer other (momentum, AdamW, update)", opt.step)
    kinds = {"KimiDeltaAttention": "KDA layer other (proj, conv, gate)", "GatedMLA": "MLA layer",
             "LatentMoE": "MoE other (sort, gather, combine, latent, shared)", "GatedMLP": "dense MLP"}
    for m in model.modules():
        label = kinds.get(type(m).__name__)
        if label is None:
            continue
        m.register_forward_pre_hook(
            lambda mod, args, _l=label: setattr(mod, "_rf", record_function(P + _l).__enter__()))
        m.register_forward_hook(lambda mod, args, out: mod._rf.__exit__(None, None, None))
    lm = model.lm_head
    lm.register_forward_pre_hook(lambda mod, args: setattr(mod, "_rf", record_function(P + "lm_head").__enter__()))
    lm.register_forward_hook(lambda mod, args, out: mod._rf.__exit__(None, None, None))


def scope_of(ev) -> str | None:
    p = ev
    while p is not None:
        if p.name.startswith(P):
            return p.name[len(P):]
        p = p.cpu_parent
    return None


def families(events) -> tuple[dict, collections.Counter]:
    """{family: {"fwd": us, "bwd": us, "calls": n}} over self CPU time, and self time per op."""
    seq_scope: dict[int, str] = {}
    for ev in events:
        if ev.sequence_nr >= 0 and not ev.name.startswith("autograd::"):
            s = scope_of(ev)
            if s is not None:
                seq_scope.setdefault(ev.sequence_nr, s)
    fam: dict[str, dict] = collections.defaultdict(lambda: {"fwd": 0.0, "bwd": 0.0, "calls": 0})
    per_op: collections.Counter = collections.Counter()
    fam_ops: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for ev in events:
        if ev.name.startswith(P) or ev.name == "ProfilerStep*":
            continue
        s, bwd, p = scope_of(ev), False, ev
        while p is not None:
            if p.name.startswith("autograd::engine::evaluate_function"):
                bwd = True
                s = seq_scope.get(p.sequence_nr, s)
                break
            p = p.cpu_parent
        if s is None:
            kind = "matmul" if ev.name in MATMUL else "copies/allocation" if ev.name in COPY else "elementwise/other"
            s = "outside the scopes: " + kind
        f = fam[s]
        f["bwd" if bwd else "fwd"] += ev.self_cpu_time_total
        f["calls"] += 1
        per_op[ev.name] += ev.self_cpu_time_total
        fam_ops[s][ev.name] += ev.self_cpu_time_total
    for name, f in fam.items():
        f["top"] = fam_ops[name].most_common(3)
    return fam, per_op


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--steps", type=int, default=2, help="profiled steps (after one warm-up)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--demo", action="store_true",
                    help="the model of `k3 demo` (tiny cut to 2 layers) instead of --preset; B16 T256 unless given")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    torch.set_flush_denormal(True)
    torch.manual_seed(0)
    if a.demo:
        from k3.cli.train import DEMO_CONFIG
        from k3.train.config import TrainConfig, resolve_model_config
        model = decoder.K3ForCausalLM(resolve_model_config(TrainConfig.build(overrides=DEMO_CONFIG)))
        a.preset = "demo"
    else:
        model = decoder.K3ForCausalLM(get_preset(a.preset))
    opt = optim.build_optimizer(model, model.config, 3e-3, 0.0)
    bal = RouterBalancer(model, "quantile")
    instrument(model, opt)
    V, B, T = model.config.vocab_size, a.batch_size, a.seq_len

    def step():
        x = torch.randint(0, V, (B, T + 1))
        opt.zero_grad(set_to_none=True)
        out = model(x[:, :-1], stats=ForwardStats())
        logits = out.logits
        with record_function(P + "loss (cross-entropy)"):
            loss = cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten())  # as Trainer._loss
        loss.backward()
        bal.collect(out.stats)
        with record_function(P + "grad clip"):
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        with record_function(P + "QB bias update"):
            bal.update()

    step()
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(a.steps):
            step()
    wall = (time.perf_counter() - t0) / a.steps
    fam, per_op = families(prof.events())
    total = sum(f["fwd"] + f["bwd"] for f in fam.values())
    cfg = f"{a.preset} B{B} T{T} threads={a.threads}"
    print(f"### {cfg}: {wall:.2f} s per step under the profiler ({total / a.steps / 1e6:.2f} s of op self time)\n")
    print("| family | % of step | forward ms | backward ms | ops called | top ops (% of the family) |\n"
          "|---|---:|---:|---:|---:|---|")
    for name, f in sorted(fam.items(), key=lambda kv: -(kv[1]["fwd"] + kv[1]["bwd"])):
        t = f["fwd"] + f["bwd"]
        if t / total < 0.002:
            continue
        top = ", ".join(f"`{o.removeprefix('aten::')}` {100 * v / t:.0f}" for o, v in f["top"])
        print(f"| {name} | {100 * t / total:.1f} | {f['fwd'] / a.steps / 1e3:.0f} | {f['bwd'] / a.steps / 1e3:.0f} "
              f"| {f['calls'] // a.steps} | {top} |")
    calls = collections.Counter()
    for ev in prof.events():
        calls[ev.name] += 1
    print("\n| top ops by self CPU time | % of step | ms per step | calls per step |\n|---|---:|---:|---:|")
    for name, t in per_op.most_common(a.top):
        print(f"| `{name}` | {100 * t / total:.1f} | {t / a.steps / 1e3:.0f} | {calls[name] // a.steps} |")
    print(f"\nops per step: {sum(calls[n] for n in per_op) // a.steps:,}")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    with open(RESULTS, "a") as fh:
        for name, f in fam.items():
            t = f["fwd"] + f["bwd"]
            fh.write(json.dumps({"bench": "profile_train", "config": cfg, "metric": f"self_cpu_share:{name}",
                                 "value": t / a.steps / 1e6, "baseline": total / a.steps / 1e6, "ratio": t / total,
                                 "calls_per_step": f["calls"] // a.steps,
                                 "time": time.strftime("%Y-%m-%dT%H:%M:%S")}) + "\n")


if __name__ == "__main__":
    main()
