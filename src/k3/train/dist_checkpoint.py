"""Distributed checkpoints with ``torch.distributed.checkpoint`` (DCP), reloadable on another world size.

A distributed run's checkpoint folder (the same versioned, manifest-checked commit as one process,
``k3.train.state``)::

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
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from k3.errors import CheckpointError

__all__ = ["save_sharded", "load_sharded", "read_dcp", "dcp_to_hf", "hf_to_dcp", "is_dcp_dir"]

_STAGE = ".dcp-stage-"


def _wrap_expert(trainer, t: torch.Tensor):
    from torch.distributed.tensor import DTensor, Replicate, Shard
    return DTensor.from_local(t, trainer.layout.mesh, [Replicate(), Shard(0)], run_check=False)


def _state(trainer) -> tuple[dict, list[tuple[torch.Tensor, torch.Tensor]]]:
    """(DCP state dict, [(wrapped, local)] pairs to copy back after a load)."""
    from torch.distributed.fsdp import FSDPModule
    for m in trainer.model.modules():  # an eval forward leaves the root's parameters gathered
        if isinstance(m, FSDPModule):
            m.reshard()
    experts = {id(p) for p in trainer.expert_params}
    back: list[tuple[torch.Tensor, torch.Tensor]] = []
    model = dict(trainer.model.state_dict())
    for n, p in trainer.model.named_parameters():
        if id(p) in experts:
            model[n] = _wrap_expert(trainer, p.detach())
            back.append((model[n], p.detach()))
    optim = {}
    for group in trainer.optimizer.param_groups:
        for name, p in zip(group["param_names"], group["params"]):
            for k, v in trainer.optimizer.state[p].items():
                key = f"{name}.{k}"
                if k == "step":
                    optim[key] = torch.tensor(int(v), dtype=torch.int64)
                elif id(p) in experts:
                    optim[key] = _wrap_expert(trainer, v)
                    back.append((optim[key], v))
                else:
                    optim[key] = v
    return {"model": model, "optim": optim}, back


def save_sharded(trainer) -> Path:
    """Collective: every rank writes its shards, rank 0 commits the checkpoint (module docstring)."""
    from k3.train.rundir import RunLock
    from k3.train.runinfo import checkpoint_bytes
    from k3.train.state import CKPT_NAME, save_checkpoint

    lay, run_dir = trainer.layout, trainer.run_dir
    stage = run_dir / f"{_STAGE}{trainer.step:08d}"
    if lay.rank == 0:
        for old in run_dir.glob(_STAGE + "*"):
            shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    state, _ = _state(trainer)
    dcp.save(state, checkpoint_id=str(stage))
    dist.barrier()
    if lay.rank == 0:
        info = {**trainer._trainer_state(), "format": "dcp", "world_size": lay.world, "dp": lay.dp,
                "ep": lay.ep}

        def write(folder: Path) -> None:
            os.rename(stage, folder / "dcp")
            trainer.tokenizer.save(folder / "tokenizer.json")
            torch.save(info, folder / "trainer_state.pt")

        with RunLock(run_dir):
            save_checkpoint(run_dir, trainer.step, write, need_bytes=checkpoint_bytes(trainer))
    dist.barrier()
    return run_dir / CKPT_NAME


def load_sharded(trainer, ckpt: Path, saved: dict) -> None:
    """Load ``ckpt/dcp`` into the (sharded) model and optimizer of this run, whatever W wrote it."""
    if saved.get("format") != "dcp":
        return _load_one_process(trainer, ckpt)
    state, back = _state(trainer)
    dcp.load(state, checkpoint_id=str(ckpt / "dcp"))
    with torch.no_grad():
        for wrapped, local in back:
            src = wrapped.to_local()
            if src.data_ptr() != local.data_ptr():
                local.copy_(src)
    for group in trainer.optimizer.param_groups:
        for name, p in zip(group["param_names"], group["params"]):
            st = trainer.optimizer.state[p]
            if "step" in st:
                st["step"] = int(state["optim"][f"{name}.step"])


@torch.no_grad()
def _load_one_process(trainer, ckpt: Path) -> None:
    """A one-process checkpoint (model/ safetensors + optimizer.pt) cut into this rank's shards."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    from k3.model.decoder import K3ForCausalLM
    from k3.train.state import load_model_weights
    full = K3ForCausalLM(trainer.model_config)
    load_model_weights(full, ckpt / "model")
    experts = {id(p) for p in trainer.expert_params}
    lay = trainer.layout

    def piece(dst: torch.Tensor, src: torch.Tensor, is_expert: bool) -> None:
        if isinstance(dst, DTensor):
            dst.to_local().copy_(distribute_tensor(src, dst.device_mesh, dst.placements,
                                                   src_data_rank=None).to_local())
        elif is_expert:
            el = src.shape[0] // lay.ep
            dst.copy_(src[lay.ep_rank * el:(lay.ep_rank + 1) * el])
        else:
            dst.copy_(src)

    _state(trainer)  # reshards the FSDP modules, so named_parameters() are the sharded ones
    full_sd = full.state_dict()
    expert_names = {n for n, p in trainer.model.named_parameters() if id(p) in experts}
    for name, t in trainer.model.state_dict().items():
        piece(t, full_sd[name], name in expert_names)
    saved = torch.load(ckpt / "optimizer.pt", map_location="cpu", weights_only=True)
    by_name = {}
    for g in saved["param_groups"]:
        for idx, name in zip(g["params"], g["param_names"]):
            by_name[name] = saved["state"].get(idx, {})
    for group in trainer.optimizer.param_groups:
        for name, p in zip(group["param_names"], group["params"]):
            st = trainer.optimizer.state[p]
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
    import tempfile

    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    folder = _dcp_folder(Path(path))
    if folder is None:
        raise CheckpointError(f"{path}: not a torch.distributed.checkpoint folder (no .metadata)")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "full.pt"
        dcp_to_torch_save(str(folder), str(out))
        return torch.load(out, weights_only=True)


def _model_config(path: Path, model_config=None):
    from k3.config import K3Config
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
    from k3.checkpoint import save_pretrained
    from k3.model.decoder import K3ForCausalLM
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
    from k3.checkpoint import from_pretrained
    model = from_pretrained(src)
    dcp.save({"model": dict(model.state_dict())}, checkpoint_id=str(dst), no_dist=True)
    return Path(dst)
