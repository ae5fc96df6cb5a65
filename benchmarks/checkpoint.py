"""Checkpoint save/load throughput of the `small` preset: k3.checkpoint vs torch.save/torch.load.

Both sides handle the same state dict in the same process and write to the same temp directory;
save includes fsync on both sides (k3 fsyncs by design, so torch.save is followed by an fsync too);
load is measured twice: into an existing model (k3 `load_checkpoint`: validation + streaming copy;
torch: `torch.load` + `load_state_dict`), and building a fresh model from the files (k3
`from_pretrained`; torch: construct the model, then the same load). Medians of repeated runs; ratios > 1
mean k3 is faster. Appends JSON lines to benchmarks/results/checkpoint.jsonl.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
from pathlib import Path

import torch
from _timing import append_results, median_time  # benchmarks/ is on sys.path when run as a script

from k3.checkpoint import from_pretrained, load_checkpoint, save_pretrained
from k3.config import get_preset
from k3.model.decoder import K3ForCausalLM

RESULTS = Path(__file__).parent / "results" / "checkpoint.jsonl"


def _torch_save(sd, path):
    torch.save(sd, path)
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


def _torch_load(path, model):
    model.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="small")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    args = ap.parse_args()
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    torch.manual_seed(0)
    model = K3ForCausalLM(get_preset(args.preset)).to(dtype)
    sd = model.state_dict()
    mb = sum(t.numel() * t.element_size() for t in sd.values()) / 1e6
    target = K3ForCausalLM(get_preset(args.preset)).to(dtype)
    tmp = Path(tempfile.mkdtemp(prefix="k3bench-"))
    try:
        k3_dir, pt = tmp / "k3", tmp / "model.pt"
        t_save_k3 = median_time(lambda: save_pretrained(model, k3_dir, max_shard_size="2GB"), args.repeats, warmup=0)
        t_save_pt = median_time(lambda: _torch_save(sd, pt), args.repeats, warmup=0)
        # into an existing model (the same `target` for both), and a fresh model from files
        t_load_k3 = median_time(lambda: load_checkpoint(target, k3_dir), args.repeats, warmup=0)
        t_load_pt = median_time(lambda: _torch_load(pt, target), args.repeats, warmup=0)
        t_new_k3 = median_time(lambda: from_pretrained(k3_dir), args.repeats, warmup=0)
        t_new_pt = median_time(lambda: _torch_load(pt, K3ForCausalLM(get_preset(args.preset)).to(dtype)),
                           args.repeats, warmup=0)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    config = f"{args.preset}/{args.dtype}"
    rows = []
    for metric, k3_t, pt_t in (("save_MBps", t_save_k3, t_save_pt), ("load_MBps", t_load_k3, t_load_pt),
                               ("build_and_load_MBps", t_new_k3, t_new_pt)):
        rows.append({"bench": "checkpoint", "config": config, "metric": metric, "value": round(mb / k3_t, 1),
                     "baseline": round(mb / pt_t, 1), "baseline_name": "torch.save/torch.load",
                     "ratio": round(pt_t / k3_t, 3), "size_MB": round(mb, 1), "repeats": args.repeats,
                     "preset": args.preset, "dtype": args.dtype, "threads": torch.get_num_threads()})
    print(f"checkpoint throughput, {config}, {mb:.1f} MB, median of {args.repeats}")
    print(f"{'metric':<22}{'k3 MB/s':>10}{'torch MB/s':>12}{'ratio':>8}")
    for r in rows:
        print(f"{r['metric']:<22}{r['value']:>10}{r['baseline']:>12}{r['ratio']:>8}")
    append_results(RESULTS, rows)


if __name__ == "__main__":
    main()
