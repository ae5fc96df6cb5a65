"""MX quantization benchmark (SPEC §8): vectorised quantize_mx vs a naive per-block loop, and the
packed MXFP4 expert footprint / decode speed (packed vs unpacked experts) of the `small` preset.

    .venv/bin/python benchmarks/mx.py [--repeats 5] [--decode-tokens 16] [--skip-model] [--threads N]

Prints a table and appends JSON lines to benchmarks/results/mx.jsonl (stamped with the machine, date
and commit by ``_timing.append_results``; each row names its thread count). Ratios only; both sides
are measured in this process.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from pathlib import Path

import torch
from _timing import append_results, median_time  # benchmarks/ is on sys.path when run as a script

from k3.ops.mx import MX_FORMATS, quantize_mx

RESULTS = Path(__file__).parent / "results" / "mx.jsonl"


def naive_quantize_mx(x: torch.Tensor, fmt: str, block: int = 32):
    """The textbook algorithm, one block and one element at a time (baseline only)."""
    f = MX_FORMATS[fmt]
    grid = sorted({abs(v) for v in _grid(f)})
    codes, scales = [], []
    for b in x.reshape(-1, block).tolist():
        if not all(math.isfinite(v) for v in b):
            scales.append(255)
            codes.extend([0] * block)
            continue
        amax = max(abs(v) for v in b)
        s = min(max((math.frexp(amax)[1] - 1 if amax else -1000) - f.emax, -127), 127)
        scales.append(s + 127)
        for v in b:
            a = min(abs(v) / 2.0**s, f.max_normal)
            i = min(range(len(grid)), key=lambda j: (abs(grid[j] - a), j % 2))  # nearest, ties to even
            codes.append(i | (f.sign_bit if math.copysign(1.0, v) < 0 else 0))
    return (torch.tensor(codes, dtype=torch.uint8).reshape(x.shape),
            torch.tensor(scales, dtype=torch.uint8).reshape(*x.shape[:-1], -1))


def _grid(f):
    for m in range(1 << (f.ebits + f.mbits)):
        if m == f.nan_code:
            continue
        e, mant = m >> f.mbits, m & ((1 << f.mbits) - 1)
        yield mant * 2.0 ** (f.emin - f.mbits) if e == 0 else (mant + (1 << f.mbits)) * 2.0 ** (e - f.bias - f.mbits)



def emit(rows: list[dict], row: dict) -> None:
    rows.append(row)
    print(f"{row['config']:<34} {row['metric']:<26} {row['value']:>14.4g} {row['baseline']:>14.4g} {row['ratio']:>9.2f}x")


def bench_quantize(rows: list[dict], repeats: int) -> None:
    torch.manual_seed(0)
    big = torch.randn(1024, 4096)      # 4M elements for the vectorised path
    small = torch.randn(16, 512)       # 8K elements for the per-block loop
    for fmt in MX_FORMATS:
        assert all(torch.equal(a, b) for a, b in zip(quantize_mx(small, fmt), naive_quantize_mx(small, fmt)))
        fast = big.numel() / median_time(lambda: quantize_mx(big, fmt), repeats)
        slow = small.numel() / median_time(lambda: naive_quantize_mx(small, fmt), max(1, repeats // 2))
        emit(rows, dict(bench="mx", config=f"quantize {fmt} fp32 block32", metric="elements_per_s",
                        value=fast, baseline=slow, ratio=fast / slow, baseline_name="per-block Python loop",
                        fmt=fmt, threads=torch.get_num_threads()))


def bench_experts(rows: list[dict], repeats: int, decode_tokens: int) -> None:
    """`small` preset: packed MXFP4 expert bytes vs bf16, and decode tokens/s packed vs unpacked."""
    import copy

    from k3.config import get_preset
    from k3.model.decoder import K3ForCausalLM
    from k3.model.mx_experts import PackedMXFP4Experts, pack_routed_experts

    cfg = get_preset("small")
    torch.manual_seed(0)
    plain = K3ForCausalLM(cfg).eval()
    packed = copy.deepcopy(plain)
    pack_routed_experts(packed)
    moes = plain.moe_layers()
    bf16 = sum(w.numel() * 2 for m in moes for w in (m.experts.w1, m.experts.w3, m.experts.w2))
    pbytes = sum(m.nbytes() for m in packed.modules() if isinstance(m, PackedMXFP4Experts))
    emit(rows, dict(bench="mx", config="small routed experts", metric="bytes packed_mxfp4 vs bf16",
                    value=pbytes, baseline=bf16, ratio=pbytes / bf16, baseline_name="bf16", preset="small"))

    ids = torch.randint(0, cfg.vocab_size, (1, 16), generator=torch.Generator().manual_seed(0))

    def decode(model):
        cache = model.new_cache(1)
        with torch.no_grad():
            tok = model(ids, cache=cache, logits_to_keep=1).logits.argmax(-1)
            t0 = time.perf_counter()
            for _ in range(decode_tokens):
                tok = model(tok, cache=cache).logits[:, -1:].argmax(-1)
            return time.perf_counter() - t0

    for _ in range(1):  # warm-up both
        decode(plain), decode(packed)
    tp = statistics.median(decode(packed) for _ in range(repeats))
    tu = statistics.median(decode(plain) for _ in range(repeats))
    emit(rows, dict(bench="mx", config=f"small decode b1 {decode_tokens} tok fp32", metric="tokens_per_s packed vs unpacked",
                    value=decode_tokens / tp, baseline=decode_tokens / tu, ratio=tu / tp, baseline_name="unpacked",
                    preset="small", decode_tokens=decode_tokens, threads=torch.get_num_threads()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--decode-tokens", type=int, default=16)
    ap.add_argument("--skip-model", action="store_true", help="quantize throughput only")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.set_flush_denormal(True)
    print(f"{'config':<34} {'metric':<26} {'value':>14} {'baseline':>14} {'ratio':>10}")
    rows: list[dict] = []
    bench_quantize(rows, args.repeats)
    if not args.skip_model:
        bench_experts(rows, args.repeats, args.decode_tokens)
    append_results(RESULTS, rows)


if __name__ == "__main__":
    main()
