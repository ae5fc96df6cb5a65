"""Inference engine speed (issue 10 "Speed"; SPEC §8 JSON lines).

Measured in one process on random weights (greedy, EOS ignored, so every request runs its full
``--gen`` tokens):

* ``decode_tps_b1`` / ``decode_tps_b16``: decode tokens/s of the Engine at batch 1 and the
  aggregate at batch 16, as (B·(N−1)) / (time(N tokens) − time(1 token)), which removes prefill
  and the first token. Baselines: recomputing the full no-cache forward each step (batch 1), and
  batch 1 itself for batch 16.
* ``roofline_b1``: batch-1 decode against this machine's limit, active weight bytes per token
  (every parameter but the embedding, routed experts k of E) ÷ measured memory read bandwidth
  (the median time of summing a 256 MiB fp32 tensor).
* ``decode_tps_b1_vs_model_step``: the engine's decode path (prepared weights) against the same
  engine decoding over the modules (``prepared_decode=False``).
* ``decode_step_b{1,16}_prepared`` / ``ops_per_step_b{1,16}``: one step of ``model(tokens, cache)``
  alone on a prefilled cache, over prepared weights (``prepared=``, ``k3.infer.prepared``) against
  the same forward over the modules, interleaved (median steps/s), and the operations one step
  dispatches (torch profiler events, deterministic, so comparable under load).
* ``decode_tps_b1_kimi_linear`` (off with ``--skip-transformers``): the same geometry in Kimi-Linear mode, k3's
  engine against transformers' ``KimiLinearForCausalLM.generate`` on the same saved weights, the two timed
  in turn (>= 3 rounds each, medians).
* ``ttft_prefix``: time to first token for a prompt sharing 90% of its tokens with a cached one,
  against the same engine on an unrelated prompt of the same length (cold).

``python benchmarks/infer.py [--preset small] [--gen 256] [--threads 2] [--device cpu]``;
prints a table (every target row with its ratio and PASS/MISS against issue 10's target) and
appends JSON lines to ``benchmarks/results/infer.jsonl``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from _timing import append_results, median_time  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "infer.jsonl"
# issue 10's targets on the ratio column: >= for speed-ups and the roofline fraction, <= for TTFT
TARGETS = {"decode_tps_b1_vs_recompute": 10.0, "decode_tps_b16_vs_b1": 6.0, "roofline_b1": 0.5,
           "decode_tps_b1_kimi_linear": 3.0, "ttft_90pct_prefix_vs_cold": 0.2}
LOWER_IS_BETTER = {"ttft_90pct_prefix_vs_cold"}


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def _prompts(B: int, T: int, V: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, V, (T,), generator=g).tolist() for _ in range(B)]


def engine_time(engine, prompts, n: int) -> float:
    from k3.infer.sampling import SamplingParams

    params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
    t0 = time.perf_counter()
    outs = engine.generate(prompts, params)
    dt = time.perf_counter() - t0
    assert all(len(o.token_ids) == n for o in outs)
    return dt


def decode_tps(engine, B: int, prompt_len: int, n: int, repeats: int) -> float:
    ps = _prompts(B, prompt_len, engine.config.vocab_size)
    t_n = statistics.median(engine_time(engine, ps, n) for _ in range(repeats))
    t_1 = statistics.median(engine_time(engine, ps, 1) for _ in range(repeats))
    return B * (n - 1) / (t_n - t_1)


@torch.no_grad()
def recompute_tps(model, prompt_len: int, n: int, device) -> float:
    """Greedy decode by running the whole sequence without a cache each step (batch 1)."""
    ids0 = torch.tensor(_prompts(1, prompt_len, model.config.vocab_size), device=device)

    def run(steps: int) -> float:
        ids = ids0
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(steps):
            nxt = model(ids, logits_to_keep=1).logits[:, -1].argmax(-1, keepdim=True)
            ids = torch.cat([ids, nxt], dim=1)
        _sync(device)
        return time.perf_counter() - t0

    run(2)
    return (n - 1) / (run(n) - run(1))


@torch.no_grad()
def step_ab(model, B: int, prompt_len: int, rounds: int = 9) -> tuple[float, float, int, int]:
    """(prepared steps/s, module-path steps/s, prepared ops/step, module ops/step) at batch B."""
    from torch.profiler import ProfilerActivity, profile

    from k3.infer.prepared import PreparedModel
    from k3.model.cache import K3Cache

    V = model.config.vocab_size
    caches = []
    for p in _prompts(B, prompt_len, V):
        c = model.new_cache(1)
        model(torch.tensor([p]), cache=c)
        caches.append(c)
    prepared = PreparedModel(model)
    steps = {True: lambda c: model(tok, cache=c, prepared=prepared), False: lambda c: model(tok, cache=c)}
    cache = {k: K3Cache.cat([c.clone() for c in caches]) for k in steps}
    tok = torch.zeros(B, 1, dtype=torch.long)
    times, ops = {True: [], False: []}, {}
    for k, s in steps.items():
        s(cache[k])
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            s(cache[k])
        ops[k] = sum(e.count for e in prof.key_averages())
    for _ in range(rounds):
        for k, s in steps.items():
            t0 = time.perf_counter()
            s(cache[k])
            times[k].append(time.perf_counter() - t0)
    return 1 / statistics.median(times[True]), 1 / statistics.median(times[False]), ops[True], ops[False]


def read_bandwidth(device) -> float:
    """Bytes/s of a full read of a 256 MiB fp32 tensor (median of 5)."""
    x = torch.ones(64 * 2**20, dtype=torch.float32, device=device)

    def f():
        x.sum().item()
    return x.numel() * 4 / median_time(f, 5, warmup=2)


def ttft_prefix(model, prompt_len: int, block: int, device) -> tuple[float, float]:
    """(cold, warm) seconds to the first token; warm shares 90% of its prompt with a cached one."""
    from k3.infer.engine import Engine

    V = model.config.vocab_size
    a, cold_p, warm_seed = _prompts(3, prompt_len, V, seed=7)
    shared = int(prompt_len * 0.9)
    warm_p = a[:shared] + warm_seed[shared:]
    with Engine(model, max_batch=1, cache_block=block, prefix_cache_bytes=1 << 31) as eng:
        engine_time(eng, [_prompts(1, prompt_len, V, seed=9)[0]], 1)  # warm-up
        engine_time(eng, [a], 1)  # fills the prefix cache
        cold = engine_time(eng, [cold_p], 1)
        warm = engine_time(eng, [warm_p], 1)
        assert eng.stats()["prefix_hit_tokens"] >= shared // block * block
    return cold, warm


def kimi_linear_geometry(cfg):
    """``cfg``'s geometry in Kimi-Linear mode (SwiGLU, plain MoE, no AttnRes / gates): a model
    transformers' ``KimiLinearForCausalLM`` runs with the same weights."""
    from k3.config import get_preset

    lac = cfg.linear_attn_config
    return get_preset(
        "kimi-linear-48b", vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
        num_hidden_layers=cfg.num_hidden_layers, num_attention_heads=cfg.num_attention_heads,
        q_lora_rank=cfg.q_lora_rank, kv_lora_rank=cfg.kv_lora_rank, qk_nope_head_dim=cfg.qk_nope_head_dim,
        qk_rope_head_dim=cfg.qk_rope_head_dim, v_head_dim=cfg.v_head_dim, intermediate_size=cfg.intermediate_size,
        num_experts=cfg.num_experts, num_experts_per_token=cfg.num_experts_per_token,
        moe_intermediate_size=cfg.moe_intermediate_size, first_k_dense_replace=cfg.first_k_dense_replace,
        max_position_embeddings=cfg.max_position_embeddings, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        linear_attn_config={"kda_layers": lac.kda_layers, "full_attn_layers": lac.full_attn_layers,
                            "num_heads": lac.num_heads, "head_dim": lac.head_dim,
                            "short_conv_kernel_size": lac.short_conv_kernel_size, "gate_lower_bound": None,
                            "use_full_rank_gate": False})


@torch.no_grad()
def vs_transformers(cfg, prompt_len: int, n: int, rounds: int = 3) -> tuple[float, float, bool]:
    """(k3 engine, transformers generate) batch-1 greedy decode tokens/s on the same weights, and
    whether both produced the same tokens. The two are timed in turn, ``rounds`` times each, and
    each side's median is kept: a slow phase of the machine then lands on both sides."""
    import tempfile

    from transformers import KimiLinearForCausalLM

    from k3.checkpoint import save_pretrained
    from k3.infer.engine import Engine
    from k3.model.decoder import K3ForCausalLM

    torch.manual_seed(0)
    model = K3ForCausalLM(kimi_linear_geometry(cfg)).eval()
    with tempfile.TemporaryDirectory() as d:
        save_pretrained(model, d)
        hf = KimiLinearForCausalLM.from_pretrained(d).eval()
    ids = torch.tensor(_prompts(1, prompt_len, cfg.vocab_size))

    # a fair baseline: same weights, same dtype, same process (so the same torch threads), cache on
    assert next(hf.parameters()).dtype == next(model.parameters()).dtype == torch.float32

    def hf_time(steps: int) -> float:
        t0 = time.perf_counter()
        out = hf.generate(ids, max_new_tokens=steps, min_new_tokens=steps, do_sample=False, use_cache=True)
        assert out.shape[1] == prompt_len + steps
        return time.perf_counter() - t0

    hf_time(2)
    hf_runs, k3_runs = [], []
    with Engine(model, max_batch=1) as eng:
        prompt = [ids[0].tolist()]
        engine_time(eng, prompt, 2)
        for _ in range(rounds):
            hf_runs.append((n - 1) / (hf_time(n) - hf_time(1)))
            k3_runs.append((n - 1) / (engine_time(eng, prompt, n) - engine_time(eng, prompt, 1)))
        from k3.infer.sampling import SamplingParams
        mine = eng.submit(ids[0].tolist(), SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)).result()
    k3_tps, hf_tps = statistics.median(k3_runs), statistics.median(hf_runs)
    theirs = hf.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                         use_cache=True)[0, prompt_len:].tolist()
    return k3_tps, hf_tps, mine.token_ids == theirs


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="small")
    p.add_argument("--gen", type=int, default=256, help="generated tokens per request")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--ttft-len", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--device", default="cpu")
    p.add_argument("--skip-recompute", action="store_true")
    p.add_argument("--skip-transformers", action="store_true",
                   help="do not time transformers' KimiLinearForCausalLM.generate on the same weights")
    args = p.parse_args(argv)

    from k3.config import get_preset
    from k3.infer.engine import Engine
    from k3.model.decoder import K3ForCausalLM
    from k3.model.summary import parameter_breakdown

    torch.set_num_threads(args.threads)
    torch.set_flush_denormal(True)
    torch.manual_seed(0)
    cfg = get_preset(args.preset)
    model = K3ForCausalLM(cfg).to(args.device).eval()
    where = f"{args.preset}, {args.device}" + (f", {args.threads} threads" if args.device == "cpu" else "")
    rows = []

    def emit(metric, value, baseline, unit):
        ratio = value / baseline if baseline else None
        verdict = ""
        if metric in TARGETS and ratio is not None:
            want = TARGETS[metric]
            lower = metric in LOWER_IS_BETTER
            ok = ratio <= want if lower else ratio >= want
            verdict = f"{'PASS' if ok else 'MISS'} ({'<=' if lower else '>='} {want})"
        rows.append(dict(bench="infer", config=where, metric=metric, value=value, baseline=baseline, ratio=ratio,
                         unit=unit, gen=args.gen, verdict=verdict or None))
        print(f"{metric:30s} {value:12.3f} {baseline if baseline is not None else float('nan'):12.3f} "
              f"{ratio if ratio is not None else float('nan'):8.2f}  {verdict:18s} {unit}", flush=True)

    print(f"{'metric':30s} {'value':>12s} {'baseline':>12s} {'ratio':>8s}  {'verdict':18s} ({where})")
    with Engine(model, max_batch=16) as eng:
        b1 = decode_tps(eng, 1, args.prompt_len, args.gen, args.repeats)
        b16 = decode_tps(eng, 16, args.prompt_len, args.gen, args.repeats)
    with Engine(model, max_batch=1, prepared_decode=False) as eng:
        b1_ref = decode_tps(eng, 1, args.prompt_len, args.gen, args.repeats)
    rec = None if args.skip_recompute else recompute_tps(model, args.prompt_len, args.gen, args.device)
    for B in (1, 16):
        new, old, ops_new, ops_old = step_ab(model, B, args.prompt_len)
        emit(f"decode_step_b{B}_prepared", new, old, "steps/s (baseline: model(...) over the modules)")
        emit(f"ops_per_step_b{B}", ops_new, ops_old, "profiler events per step (baseline: over the modules)")
    emit("decode_tps_b1_vs_recompute", b1, rec, "tokens/s (baseline: full forward each step)")
    emit("decode_tps_b16_vs_b1", b16, b1, "aggregate tokens/s (baseline: batch 1)")
    emit("decode_tps_b1_vs_model_step", b1, b1_ref,
         "tokens/s (baseline: the engine decoding over the modules, prepared_decode=False)")
    active = parameter_breakdown(model).activated * next(model.parameters()).element_size()
    bw = read_bandwidth(args.device)
    emit("roofline_b1", b1, bw / active, f"tokens/s (baseline: {active / 1e6:.1f} MB active / {bw / 1e9:.1f} GB/s)")
    if not args.skip_transformers:
        k3_tps, hf_tps, same = vs_transformers(cfg, args.prompt_len, args.gen, max(3, args.repeats))
        emit("decode_tps_b1_kimi_linear", k3_tps, hf_tps,
             f"tokens/s (baseline: transformers generate; same tokens: {same})")
    cold, warm = ttft_prefix(model, args.ttft_len, 64, args.device)
    emit("ttft_90pct_prefix_vs_cold", warm * 1000, cold * 1000, f"ms for {args.ttft_len} tokens (ratio < 1 = faster)")
    append_results(RESULTS, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
