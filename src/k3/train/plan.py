"""Per-device memory and per-step communication of a config on a cluster (docs/PLAN.md).

Layout (SPEC §5): ``devices`` = R · dp · ep, a mesh of dp × ep repeated R times (R replicas, plain
data parallel between them). Inside a mesh, dense/attention parameters are FSDP-sharded over all
S = dp·ep ranks; routed experts are split over the ep ranks (num_experts/ep each) and each expert
slice is FSDP-sharded over the dp ranks — so both kinds end up at 1/S of the model per device.
Training keeps fp32 master parameters, fp32 gradients and fp32 optimizer state (what
``k3.train.optim.Muon`` allocates: ``momentum_buffer`` for Muon parameters, ``exp_avg`` +
``exp_avg_sq`` for AdamW ones); compute and communication run in bf16 (``--dtype``).

Inference: the same ep split of routed experts, packed MXFP4; every other tensor bf16 on every
device (no tensor parallelism); KDA state + MLA latent cache per sequence from
:func:`k3.model.cache.cache_bytes_per_sequence`.
"""

from __future__ import annotations

import math
import re

import torch

from k3.errors import K3Error
from k3.train.plan_activations import activation_bytes
from k3.train.plan_sizes import (RELEASE_CHECKPOINT_GIB, RELEASE_SHARDS, RELEASE_VISION_CONFIG,
                                 checkpoint_bytes, param_split, vision_bytes)

__all__ = ["parse_bytes", "all_to_all_bytes_per_step", "all_to_all_capacity_bytes_per_step",
           "fsdp_bytes_per_step", "train_plan", "inference_plan", "checkpoint_summary", "format_plan",
           "checkpoint_bytes", "RELEASE_CHECKPOINT_GIB", "DTYPES"]

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
F32 = 4


def parse_bytes(text: str, what: str = "--device-memory") -> int:
    """'141GB' -> 141·10⁹, '80GiB' -> 80·2³⁰, '1.5TB', '4096' (bytes); anything else is a K3Error."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*", str(text), flags=re.IGNORECASE)
    if not m:
        raise K3Error(f"{what}: cannot parse {text!r} as a size (use e.g. 141GB, 80GiB or a byte count)")
    value = float(m.group(1)) * _UNITS[(m.group(2) or "").lower()]
    if value <= 0:
        raise K3Error(f"{what}: must be > 0, got {text!r}")
    return int(value)


def _moe_layers(config) -> int:
    return sum(config.is_moe_layer(l) for l in range(config.num_hidden_layers))


def all_to_all_bytes_per_step(config, tokens_per_rank: int, ep: int, dtype: torch.dtype) -> int:
    """Bytes one rank sends through expert-parallel all-to-alls in one training step.

    Per MoE layer each of the rank's tokens sends k slot vectors of the expert width ℓ
    (``expert_dim``: the latent, LatentMoE dispatches after ``routed_expert_down_proj``) to the
    ranks owning their experts (dispatch), and gets them back (combine); the backward pass sends
    the two gradients the same way. Under balanced routing a slot stays on its own rank with
    probability 1/ep, so the bytes that leave the rank are::

        n_moe_layers · 4 · tokens_per_rank · k · ℓ · itemsize · (ep − 1) / ep

    (4 = dispatch + combine, forward + backward; integer-floored). Counting the rank's own chunk
    too (what an ``all_to_all_single`` buffer holds) multiplies this by ep/(ep − 1).
    """
    for name, v in (("tokens_per_rank", tokens_per_rank), ("ep", ep)):
        if isinstance(v, bool) or not isinstance(v, int) or v < (0 if name == "tokens_per_rank" else 1):
            raise K3Error(f"{name} must be an int {'>= 0' if name == 'tokens_per_rank' else '>= 1'}, got {v!r}")
    if config.num_experts and config.num_experts % ep:
        raise K3Error(f"num_experts ({config.num_experts}) is not divisible by ep ({ep})")
    slots = _moe_layers(config) * 4 * tokens_per_rank * config.num_experts_per_token
    return slots * config.expert_dim * dtype.itemsize * (ep - 1) // ep


def all_to_all_capacity_bytes_per_step(config, tokens_per_rank: int, ep: int, dtype: torch.dtype,
                                       capacity_factor: float) -> int:
    """The same traffic through fixed-capacity buffers (static shapes, SPEC §5): every pass sends the
    whole [E, C, ℓ] buffer, C = ceil(capacity_factor · tokens_per_rank · k / E) slots per expert
    (``LatentMoE.capacity``), empty slots included; (ep − 1)/ep of it leaves the rank::

        n_moe_layers · 4 · E · C · ℓ · itemsize · (ep − 1) / ep
    """
    if isinstance(capacity_factor, bool) or not isinstance(capacity_factor, (int, float)) or capacity_factor <= 0:
        raise K3Error(f"capacity_factor must be a number > 0, got {capacity_factor!r}")
    all_to_all_bytes_per_step(config, tokens_per_rank, ep, dtype)  # the same argument checks
    E = config.num_experts
    if not E:
        return 0
    cap = max(1, math.ceil(capacity_factor * tokens_per_rank * config.num_experts_per_token / E))
    return _moe_layers(config) * 4 * E * cap * config.expert_dim * dtype.itemsize * (ep - 1) // ep


def fsdp_bytes_per_step(split: dict, dp: int, ep: int, replicas: int, grad_accum: int,
                        itemsize: int, reduce_itemsize: int = F32) -> dict[str, int]:
    """Bytes one rank receives (all-gather) / sends (reduce-scatter, all-reduce) per optimizer step.

    Ring collectives over g ranks move (g − 1)/g of the full tensor through each rank. Dense
    parameters form groups of S = dp·ep ranks, each expert slice (routed/ep) a group of dp ranks:

        all_gather     = grad_accum · 2 · [dense·(S−1)/S + experts/ep·(dp−1)/dp] · itemsize
                         (forward, and again in backward: FSDP2 reshards after forward)
        reduce_scatter = [dense·(S−1)/S + experts/ep·(dp−1)/dp] · reduce_itemsize   (last micro-batch)
        all_reduce     = 2·(R−1)/R · (parameters / S) · reduce_itemsize            (across R replicas)
    """
    S = dp * ep
    dense, experts = split["non_expert"], split["routed_experts"]
    full = dense * (S - 1) / S + experts / ep * (dp - 1) / dp
    shard = split["total"] / S
    return {"all_gather": int(grad_accum * 2 * full * itemsize),
            "reduce_scatter": int(full * reduce_itemsize),
            "all_reduce": int(2 * (replicas - 1) / replicas * shard * reduce_itemsize)}


def _check_layout(config, devices: int, dp: int, ep: int, ep_flag: str = "--ep") -> int:
    """The number of replicas R = devices / (dp · ep); K3Error naming the flag when it is not whole."""
    for name, v in (("--devices", devices), ("--dp", dp), (ep_flag, ep)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise K3Error(f"{name} must be an int >= 1, got {v!r}")
    if devices % (dp * ep):
        what = f"{ep_flag} {ep}" if ep_flag != "--ep" else f"dp × ep = {dp} × {ep} = {dp * ep}"
        raise K3Error(f"--devices {devices} is not divisible by {what}")
    if config.num_experts and config.num_experts % ep:
        raise K3Error(f"num_experts ({config.num_experts}) is not divisible by {ep_flag} {ep}")
    return devices // (dp * ep)


def train_plan(config, devices: int, device_memory: int, dp: int, ep: int, seq_len: int = 4096,
               micro_batch: int = 1, grad_accum: int = 1, recompute: bool = False,
               dtype: torch.dtype = torch.bfloat16, attention: str = "fused") -> dict:
    """Per-device training memory (bytes) and per-step communication; see the module docstring."""
    R = _check_layout(config, devices, dp, ep)
    for name, v in (("--seq-len", seq_len), ("--micro-batch", micro_batch), ("--grad-accum", grad_accum)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise K3Error(f"{name} must be an int >= 1, got {v!r}")
    S, e = dp * ep, dtype.itemsize
    sp = param_split(config)
    per = lambda n: math.ceil(n / S)  # noqa: E731 - one parameter count's share on one device
    # FSDP all-gathers a layer's dense part when S > 1 and its expert slice when dp > 1
    gathered = max(((ne if S > 1 else 0) + (ex / ep if dp > 1 else 0) for ne, ex in sp["layers"]), default=0)
    tokens = micro_batch * seq_len
    act = activation_bytes(config, micro_batch, seq_len, e, attention)
    moe = ep > 1 and _moe_layers(config) > 0
    a2a_buf = 2 * 2 * tokens * config.num_experts_per_token * config.expert_dim * e if moe else 0
    mem = {"parameters": per(sp["total"]) * F32, "gradients": per(sp["parameters"] - sp["no_grad"]) * F32,
           "optimizer_muon_momentum": per(sp["muon"] + sp["muon_experts"]) * F32,
           "optimizer_adamw_moments": per(sp["adamw"]) * 2 * F32,
           "fsdp_gather_buffers": int(2 * gathered * e),
           "activations": act["recompute"] if recompute else act["full"],
           "all_to_all_buffers": a2a_buf}
    total = sum(mem.values())
    comm = fsdp_bytes_per_step(sp, dp, ep, R, grad_accum, e)
    comm["all_to_all"] = all_to_all_bytes_per_step(config, tokens * grad_accum, ep, dtype)
    return {"layout": {"devices": devices, "dp": dp, "ep": ep, "replicas": R, "experts_per_rank":
                       config.num_experts // ep if config.num_experts else 0, "seq_len": seq_len,
                       "micro_batch": micro_batch, "grad_accum": grad_accum, "recompute": recompute,
                       "dtype": str(dtype).removeprefix("torch."), "attention": attention},
            "params": sp | {"layers": len(sp["layers"])}, "memory": mem, "total": total,
            "device_memory": device_memory, "headroom": device_memory - total, "fits": total <= device_memory,
            "activations": {"full": act["full"], "recompute": act["recompute"], "terms": act["terms"]},
            "comm": comm}


def inference_plan(config, devices: int, device_memory: int, ep: int, context: int,
                   dtype: torch.dtype = torch.bfloat16) -> dict:
    """Per-device inference memory with packed MXFP4 experts and how many sequences fit at ``context``."""
    from k3.model.cache import cache_bytes_per_sequence

    R = _check_layout(config, devices, 1, ep, "--infer-ep")
    if isinstance(context, bool) or not isinstance(context, int) or context < 1:
        raise K3Error(f"--context must be an int >= 1, got {context!r}")
    ck = checkpoint_bytes(config, packed=True, dtype=dtype)
    weights = ck["other"] + math.ceil(ck["experts"] / ep)
    cache = cache_bytes_per_sequence(config, context, dtype)
    free = device_memory - weights
    fit = max(0, free // cache["total"]) if cache["total"] else 0
    return {"ep": ep, "replicas": R, "weights": weights, "weights_experts": math.ceil(ck["experts"] / ep),
            "weights_other": ck["other"], "context": context, "kda_state": cache["kda_state"],
            "mla_latent": cache["mla_latent"], "per_sequence": cache["total"],
            "all_mla_per_sequence": cache["all_mla_equivalent"], "free_after_weights": free,
            "sequences": int(fit), "fits": free > 0 and fit >= 1}


def checkpoint_summary(config) -> dict:
    """Packed text checkpoint bytes, the vision tower's, and (for the K3 shape) the release comparison."""
    ck = checkpoint_bytes(config, packed=True)
    vc = config.vision_config or (RELEASE_VISION_CONFIG if _is_k3_release(config) else None)
    vis = vision_bytes(vc)
    out = {"text": ck["total"], "experts": ck["experts"], "vision": vis, "total": ck["total"] + vis}
    if _is_k3_release(config):
        out.update(release_gib=RELEASE_CHECKPOINT_GIB, release_shards=RELEASE_SHARDS)
    return out


def _is_k3_release(config) -> bool:
    return (config.num_experts, config.hidden_size, config.num_hidden_layers) == (896, 7168, 93)


def _g(b: float) -> str:
    return f"{b / 1e9:,.2f} GB ({b / 2**30:,.2f} GiB)"


def format_plan(name: str, tp: dict, ip: dict, ck: dict) -> str:
    """The human-readable report of ``k3 plan``."""
    lay, m = tp["layout"], tp["memory"]
    lines = [f"k3 plan: {name} on {lay['devices']} devices = {lay['replicas']} replica(s) × dp {lay['dp']} × "
             f"ep {lay['ep']} ({lay['experts_per_rank']} experts per ep rank); micro-batch {lay['micro_batch']} "
             f"× {lay['seq_len']} tokens, grad-accum {lay['grad_accum']}, {lay['dtype']} compute, "
             f"{lay['attention']} attention", "training memory per device:"]
    for k, v in m.items():
        lines.append(f"  {k:<26}{_g(v):>34}")
    a = tp["activations"]
    lines += [f"  (activations per micro-batch: {_g(a['full'])} saved for backward, {_g(a['recompute'])} "
              f"peak with per-layer recomputation; {'recompute' if lay['recompute'] else 'no recompute'} used)",
              f"  {'total':<26}{_g(tp['total']):>34}",
              f"  verdict: {'FITS' if tp['fits'] else 'DOES NOT FIT'} in {_g(tp['device_memory'])}: headroom "
              f"{_g(tp['headroom'])}", "communication per device per step:"]
    for k, v in tp["comm"].items():
        lines.append(f"  {k:<26}{_g(v):>34}")
    sp = tp["params"]
    lines.insert(1, f"parameters + buffers {sp['total']:,} ({sp['routed_experts']:,} routed-expert), "
                    f"activated per token {sp['activated']:,}; optimizer: Muon "
                    f"{sp['muon'] + sp['muon_experts']:,} (momentum), AdamW {sp['adamw']:,} (two moments)")
    lines += [f"inference on ep {ip['ep']} × {ip['replicas']} replica(s) (routed experts packed MXFP4, "
              f"{ip['context']:,}-token context):",
              f"  weights per device        {_g(ip['weights']):>34}  (experts {_g(ip['weights_experts'])}, "
              f"rest bf16 {_g(ip['weights_other'])})",
              f"  per sequence              {_g(ip['per_sequence']):>34}  (KDA state {_g(ip['kda_state'])}, "
              f"MLA latent {_g(ip['mla_latent'])}; all-MLA would be {_g(ip['all_mla_per_sequence'])})",
              f"  sequences that fit        {ip['sequences']:>34,}  ({_g(max(0, ip['free_after_weights']))} "
              f"free after weights)" if ip["free_after_weights"] > 0 else
              "  sequences that fit                                 0  (the weights alone do not fit)",
              f"checkpoint: text {_g(ck['text'])} (MXFP4 experts {_g(ck['experts'])})"
              + (f" + vision tower {_g(ck['vision'])} = {_g(ck['total'])}" if ck["vision"] else "")]
    if "release_gib" in ck:
        lines.append(f"  release: {ck['release_gib']:,} GiB in {ck['release_shards']} shards; text + vision = "
                     f"{ck['total'] / 2**30:,.2f} GiB")
    return "\n".join(lines)
