"""Re-export any supported checkpoint (``convert``), summarise one from its headers (``inspect``):
what ``k3 convert`` and ``k3 inspect`` run (``k3.cli.checkpoint``)."""

from __future__ import annotations

import os
import re
from collections import Counter, defaultdict

import torch

from k3.checkpoint.load import CheckpointFiles, checkpoint_dtype, load_state_dict, plan_load, scan
from k3.checkpoint.save import save_state_dict
from k3.errors import CheckpointError

__all__ = ["convert", "inspect", "DTYPE_ARGS"]

DTYPE_ARGS = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16,
              "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16}


def convert(src: str | os.PathLike, dst: str | os.PathLike, dtype: torch.dtype | None = None,
            max_shard_size: int | str = "2GB", strict: bool = True, verify: bool = True) -> list[str]:
    """Read ``src`` (k3, K3 release, Kimi-Linear) and write it to ``dst`` in k3's layout.

    ``verify``: check the source's sha256 hashes first; the output carries its own."""
    if os.path.realpath(src) == os.path.realpath(dst):
        raise CheckpointError(f"{dst}: convert: source and destination are the same directory")
    config, sd = load_state_dict(src, dtype=dtype, strict=strict, verify=verify)
    return save_state_dict(sd, config, dst, max_shard_size)


def _pattern(name: str) -> str:
    return re.sub(r"\.(\d+)\.", lambda m: ".{e}." if "experts" in name[: m.start()] else ".{l}.", name)


def _count(n: float) -> str:
    for unit, div in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= div:
            return f"{n / div:.2f}{unit}"
    return str(int(n))


def _quantization_lines(files: CheckpointFiles) -> list[str]:
    """The declared quantization_config (if any) and the packed expert tensors actually stored."""
    lines = []
    qc = files.quantization
    if isinstance(qc, dict):
        lines.append(f"  quantization_config: {qc.get('quant_method')} {qc.get('format')}"
                     f" (status {qc.get('quantization_status')})")
        for gname, g in (qc.get("config_groups") or {}).items():
            w = (g or {}).get("weights") or {}
            lines.append(f"    {gname}: targets {g.get('targets')}, weights {w.get('type')}{w.get('num_bits')} "
                         f"{w.get('strategy')} {w.get('group_size')} (scale {w.get('scale_dtype')}), "
                         f"input_activations {g.get('input_activations')}")
        lines.append(f"    ignore: {', '.join(map(str, qc.get('ignore') or [])) or '-'}")
    elif qc is not None:
        lines.append(f"  quantization_config: {qc!r}")
    packed = [i for n, i in files.tensors.items() if n.endswith((".weight_packed", ".weight_scale"))]
    if packed:
        nb = sum(i.numel * i.dtype.itemsize for i in packed)
        lines.append(f"  packed MXFP4 experts: {sum(i.name.endswith('_packed') for i in packed)} matrices "
                     f"(.weight_packed + .weight_scale), {nb:,} bytes")
    return lines


def inspect(directory: str | os.PathLike, verify: bool = True) -> str:
    """Config summary, parameter counts and dtype/shape statistics, from config and headers (and,
    with ``verify``, the shards' sha256 check, which reads every byte once)."""
    files = scan(directory, verify)
    cfg = files.config
    plan = plan_load(files, cfg, strict=False)
    lac = cfg.linear_attn_config
    lines = [
        f"checkpoint {files.directory}" + (" (multimodal layout: language_model.*)" if files.multimodal else ""),
        f"  layers {cfg.num_hidden_layers}: {len(cfg.kda_layer_ids)} KDA ({lac.num_heads}x{lac.head_dim}), "
        f"{len(cfg.mla_layer_ids)} MLA ({cfg.num_attention_heads} heads)",
        f"  hidden {cfg.hidden_size}, vocab {cfg.vocab_size}, experts {cfg.num_experts} top-{cfg.num_experts_per_token}"
        f" + {cfg.num_shared_experts} shared, expert width {cfg.moe_intermediate_size}"
        + (f", latent {cfg.routed_expert_hidden_size}" if cfg.uses_latent_moe else "")
        + (f", AttnRes block {cfg.attn_res_block_size}" if cfg.attn_res_block_size else ""),
        f"  dominant dtype {str(checkpoint_dtype(files)).replace('torch.', '')}, "
        f"{len({i.file for i in files.tensors.values()})} shard file(s)",
    ]
    params, routed, nbytes = 0, 0, 0
    by_dtype: Counter = Counter()
    groups: dict[tuple[str, str, tuple], int] = defaultdict(int)
    text = {i.name for items in plan.by_file.values() for _, i in items}
    for name, info in files.tensors.items():
        size = info.numel * info.dtype.itemsize
        nbytes += size
        by_dtype[str(info.dtype).replace("torch.", "")] += size
        groups[(_pattern(name), str(info.dtype).replace("torch.", ""), info.shape)] += 1
        if name not in text:
            continue
        n = info.numel * (2 if name.endswith(".weight_packed") else 1)  # two FP4 codes per byte
        if name.endswith(".weight_scale"):
            n = 0
        params += n
        routed += n if ".experts." in name else 0
    active = params - routed + (routed * cfg.num_experts_per_token // max(cfg.num_experts, 1))
    lines += [f"  parameters {params:,} ({_count(params)}), routed experts {routed:,} ({_count(routed)}), "
              f"activated per token ~{_count(active)} (incl. embedding)",
              f"  tensors {len(files.tensors)}, {nbytes / 1e6:.1f} MB: "
              + ", ".join(f"{d} {b / 1e6:.1f} MB" for d, b in by_dtype.most_common())]
    lines += _quantization_lines(files)
    if plan.ignored:
        lines.append(f"  ignored (vision/projector): {len(plan.ignored)} tensors")
    if plan.unexpected:
        lines.append(f"  unexpected for this config: {len(plan.unexpected)} tensors, e.g. {plan.unexpected[0]}")
    lines.append(f"  {'count':>6}  {'dtype':<9}{'shape':<20}name")
    for (pat, dt, shape), c in sorted(groups.items()):
        lines.append(f"  {c:>6}  {dt:<9}{str(list(shape)):<20}{pat}")
    return "\n".join(lines)
