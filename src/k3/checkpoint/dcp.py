"""Distributed checkpoints with ``torch.distributed.checkpoint`` (DCP), reloadable on another world size.

A distributed run's checkpoint folder (the same versioned, manifest-checked commit as one process,
:mod:`k3.checkpoint.training`)::

    dcp/                .metadata + one __<rank>_0.distcp file per writing rank: every tensor under
                        its global name and shape; DCP reshards on load, so W=4 -> W=2 just works
    tokenizer.json
    trainer_state.pt    as one process (step, data cursors, RNG, metrics, configs) + "format": "dcp",
                        world_size, dp, ep
    manifest.json

Tensors in ``dcp/``: ``model.<name>`` (FSDP DTensor shards; routed experts as DTensors
[Replicate over dp, Shard(0) over ep], i.e. the global [E, …] stack; router biases replicated) and
``optim.<name>.<state>`` (Muon momentum, AdamW moments, AdamW step as an int64 scalar).
A one-process checkpoint (``model/`` + ``optimizer.pt``) also resumes under torchrun: every rank
reads the full tensors and keeps its shard.

All ranks write their shards into a staging folder ``.dcp-stage-<step>``; rank 0 (the holder of
the run lock) then commits it together with the small files.

The functions take the pieces of a run, not a trainer: the model (FSDP-sharded, routed experts
local to the rank), its optimizer (param groups with ``param_names``), the routed-expert
parameters and the ("dp", "ep") DeviceMesh (``k3.train.distributed`` holds them).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from k3.checkpoint.pretrained import from_pretrained, save_pretrained
from k3.checkpoint.rundir import RunLock
from k3.checkpoint.training import CKPT_NAME, load_model_weights, save_checkpoint
from k3.config import K3Config
from k3.errors import CheckpointError
from k3.model.decoder import K3ForCausalLM

__all__ = ["save_sharded", "load_sharded", "expert_dtensor", "reshard", "read_dcp", "dcp_to_hf", "hf_to_dcp",
           "is_dcp_dir"]

_STAGE = ".dcp-stage-"


def expert_dtensor(mesh, t: torch.Tensor) -> DTensor:
    """A rank's routed-expert stack [E/ep, …] as the global [E, …] DTensor (Replicate over dp,
    Shard(0) over ep) of the ("dp", "ep") ``mesh``."""
    return DTensor.from_local(t, mesh, [Replicate(), Shard(0)], run_check=False)


def reshard(model: torch.nn.Module) -> None:
    """Free the FSDP modules' gathered parameters (an eval forward leaves the root's gathered)."""
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


def _state(model, optimizer, expert_params, mesh) -> tuple[dict, list[tuple[torch.Tensor, torch.Tensor]]]:
    """(DCP state dict, [(wrapped, local)] pairs to copy back after a load)."""
    reshard(model)
    experts = {id(p) for p in expert_params}
    back: list[tuple[torch.Tensor, torch.Tensor]] = []
    sd = dict(model.state_dict())
    for n, p in model.named_parameters():
        if id(p) in experts:
            sd[n] = expert_dtensor(mesh, p.detach())
            back.append((sd[n], p.detach()))
    optim = {}
    for group in optimizer.param_groups:
        for name, p in zip(group["param_names"], group["params"]):
            for k, v in optimizer.state[p].items():
                key = f"{name}.{k}"
                if k == "step":
                    optim[key] = torch.tensor(int(v), dtype=torch.int64)
                elif id(p) in experts:
                    optim[key] = expert_dtensor(mesh, v)
                    back.append((optim[key], v))
                else:
                    optim[key] = v
    return {"model": sd, "optim": optim}, back


def save_sharded(run_dir: Path, step: int, model, optimizer, expert_params, mesh, rank: int,
                 write_rest: Callable[[Path], None], need_bytes: Callable[[], int]) -> Path:
    """Collective: every rank writes its shards, rank 0 commits the checkpoint with what
    ``write_rest(folder)`` puts beside ``dcp/`` (tokenizer, trainer state; module docstring).
    ``need_bytes()``: the free space the commit checks for (asked on rank 0 only)."""
    stage = run_dir / f"{_STAGE}{step:08d}"
    if rank == 0:
        for old in run_dir.glob(_STAGE + "*"):
            shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    state, _ = _state(model, optimizer, expert_params, mesh)
    dcp.save(state, checkpoint_id=str(stage))
    dist.barrier()
    if rank == 0:
        def write(folder: Path) -> None:
            os.rename(stage, folder / "dcp")
            write_rest(folder)

        with RunLock(run_dir):
            save_checkpoint(run_dir, step, write, need_bytes=need_bytes())
    dist.barrier()
    return run_dir / CKPT_NAME


def load_sharded(ckpt: Path, saved: dict, model, optimizer, expert_params, mesh, model_config) -> None:
    """Load ``ckpt/dcp`` into the (sharded) model and optimizer of this run, whatever W wrote it; a
    one-process checkpoint (``saved`` without ``"format": "dcp"``) is cut into this rank's shards."""
    if saved.get("format") != "dcp":
        return _load_one_process(ckpt, model, optimizer, expert_params, mesh, model_config)
    state, back = _state(model, optimizer, expert_params, mesh)
    dcp.load(state, checkpoint_id=str(ckpt / "dcp"))
    with torch.no_grad():
        for wrapped, local in back:
            src = wrapped.to_local()
            if src.data_ptr() != local.data_ptr():
                local.copy_(src)
    for group in optimizer.param_groups:
        for name, p in zip(group["param_names"], group["params"]):
            st = optimizer.state[p]
            if "step" in st:
                st["step"] = int(state["optim"][f"{name}.step"])


@torch.no_grad()
def _load_one_process(ckpt: Path, model, optimizer, expert_params, mesh, model_config) -> None:
    """A one-process checkpoint (model/ safetensors + optimizer.pt) cut into this rank's shards."""
    full = K3ForCausalLM(model_config)
    load_model_weights(full, ckpt / "model")
    experts = {id(p) for p in expert_params}
    ep, ep_rank = mesh["ep"].size(), mesh["ep"].get_local_rank()

    def piece(dst: torch.Tensor, src: torch.Tensor, is_expert: bool) -> None:
        if isinstance(dst, DTensor):
            dst.to_local().copy_(distribute_tensor(src, dst.device_mesh, dst.placements,
                                                   src_data_rank=None).to_local())
        elif is_expert:
            el = src.shape[0] // ep
            dst.copy_(src[ep_rank * el:(ep_rank + 1) * el])
        else:
            dst.copy_(src)

    reshard(model)  # so named_parameters() are the sharded ones
    full_sd = full.state_dict()
    expert_names = {n for n, p in model.named_parameters() if id(p) in experts}
    for name, t in model.state_dict().items():
        piece(t, full_sd[name], name in expert_names)
    saved = torch.load(ckpt / "optimizer.pt", map_location="cpu", weights_only=True)
    by_name = {}
    for g in saved["param_groups"]:
        for idx, name in zip(g["params"], g["param_names"]):
            by_name[name] = saved["state"].get(idx, {})
    for group in optimizer.param_groups:
        for name, p in zip(group["param_names"], group["params"]):
            st = optimizer.state[p]
            for k, v in by_name.get(name, {}).items():
                if k == "step":
                    st[k] = int(v)
                else:
                    piece(st[k], v.to(st[k].dtype), id(p) in experts)


# ----------------------------------------------------------------------- conversion (k3 convert)
def is_dcp_dir(path: str | os.PathLike) -> bool:
    """A DCP folder (``.metadata``), or a training checkpoint / run folder holding one."""
    return _dcp_folder(Path(path)) is not None


def _dcp_folder(p: Path) -> Path | None:
    for cand in (p, p / "dcp", p / "checkpoint" / "dcp"):
        if (cand / ".metadata").is_file():
            return cand
    return None


def read_dcp(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Every tensor of a DCP checkpoint as a full tensor (one process, no process group)."""
    folder = _dcp_folder(Path(path))
    if folder is None:
        raise CheckpointError(f"{path}: not a torch.distributed.checkpoint folder (no .metadata)")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "full.pt"
        dcp_to_torch_save(str(folder), str(out))
        return torch.load(out, weights_only=True)


def _model_config(path: Path, model_config=None):
    if model_config is not None:
        return model_config
    for cand in (path.parent / "trainer_state.pt", path / "trainer_state.pt",
                 path / "checkpoint" / "trainer_state.pt"):
        if cand.is_file():
            return K3Config.from_dict(torch.load(cand, weights_only=False)["model_config"])
    raise CheckpointError(f"{path}: no trainer_state.pt beside the DCP folder to read the model "
                          "config from")


def dcp_to_hf(src: str | os.PathLike, dst: str | os.PathLike, model_config=None) -> Path:
    """A DCP checkpoint (training or model-only) -> k3's HF safetensors layout in ``dst``."""
    folder = _dcp_folder(Path(src))
    if folder is None:
        raise CheckpointError(f"{src}: not a torch.distributed.checkpoint folder (no .metadata)")
    full = read_dcp(folder)
    sd = full["model"] if isinstance(full.get("model"), dict) else full  # training or model-only
    config = _model_config(folder, model_config)
    with torch.device("meta"):
        model = K3ForCausalLM(config)
    missing, unexpected = model.load_state_dict(sd, strict=False, assign=True)
    if missing or unexpected:
        raise CheckpointError(f"{src}: the DCP tensors do not match the model config (missing "
                              f"{sorted(missing)[:3]}, unexpected {sorted(unexpected)[:3]})")
    save_pretrained(model, dst)
    return Path(dst)


def hf_to_dcp(src: str | os.PathLike, dst: str | os.PathLike) -> Path:
    """k3 / HF safetensors -> a model-only DCP folder (``model.<name>`` tensors, as training writes)."""
    model = from_pretrained(src)
    dcp.save({"model": dict(model.state_dict())}, checkpoint_id=str(dst), no_dist=True)
    return Path(dst)
