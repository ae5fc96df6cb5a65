"""How a run is spread over processes: the parallelism object of the one Trainer (SPEC §1, §5).

The Trainer (``k3.train.loop``) is written once; everything that differs between one process and a
``torchrun`` job is a method of its ``parallel`` object:

    rank, world, device          this process's place (0, 1 in one process)
    configure(tc)                the run's options as this layout trains them
    barrier()                    wait for every process
    sum(values) / reduce_(t, op) loss, label and evaluation sums; the stop flag; objectives' sums
    gather_objects(obj)          every process's object, in rank order
    shard_batches(data, B)       this process's rows of each global batch
    eval_rows(batch, B)          this process's rows of a validation batch
    parallelize(model, ...)      shard the model (FSDP2, expert parallelism)
    optimizer_class              Muon, or ShardedMuon on shards
    balancer_reduce              the in-place all-reduce of the router statistics (None: local)
    grad_scale                   what the summed loss is multiplied by so the reduced gradient is
                                 the gradient of the step's loss
    sync_grads(model)            finish gradients after the micro-batches
    clip_grad_norm_(model, max)  the global gradient norm, clipped
    stops_at_step_boundary       a stop signal is acted on at the next step, by every rank at once
    save_checkpoint / load_checkpoint / full_state_dict / param_count   the checkpoint formats

:class:`SingleProcess` is the one-process implementation: every reduction is the identity.
``k3.train.distributed.Distributed`` is the dp × ep one (FSDP2, expert parallelism, ShardedMuon,
gloo / NCCL reductions, DCP checkpoints).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Protocol, Sequence

import torch
from torch import nn

from k3.checkpoint.rundir import RunLock
from k3.checkpoint.training import load_model_weights, save_checkpoint, save_model_weights
from k3.errors import CheckpointError
from k3.train.optim import Muon

__all__ = ["Parallelism", "SingleProcess", "check_reduce_op"]

REDUCE_OPS = ("sum", "max")


def check_reduce_op(op: str) -> None:
    if op not in REDUCE_OPS:
        raise ValueError(f"reduce_: op must be 'sum' or 'max', got {op!r}")


class Parallelism(Protocol):
    """What the Trainer asks of a layout (module docstring)."""

    rank: int
    world: int
    stops_at_step_boundary: bool
    optimizer_class: type
    balancer_reduce: Callable[[torch.Tensor], None] | None
    grad_scale: float

    def configure(self, tc: Any) -> Any: ...
    def barrier(self) -> None: ...
    def sum(self, values: Sequence[float]) -> list[float]: ...
    def reduce_(self, t: torch.Tensor, op: str = "sum") -> torch.Tensor: ...
    def gather_objects(self, obj: Any) -> list: ...
    def shard_batches(self, data: Any, batch_size: int) -> Any: ...
    def eval_rows(self, batch: tuple[torch.Tensor, ...], batch_size: int) -> tuple[torch.Tensor, ...]: ...
    def parallelize(self, model: nn.Module, tc: Any, model_config: Any) -> None: ...
    def sync_grads(self, model: nn.Module) -> None: ...
    def clip_grad_norm_(self, model: nn.Module, max_norm: float) -> float: ...
    def save_checkpoint(self, run_dir: Path, step: int, model: nn.Module, optimizer, tokenizer,
                        trainer_state: Callable[[], dict], need_bytes: Callable[[], int]) -> Path: ...
    def load_checkpoint(self, ckpt: Path, saved: dict, model: nn.Module, optimizer, model_config,
                        device: torch.device) -> None: ...
    def full_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]: ...
    def param_count(self, model: nn.Module) -> int: ...


class SingleProcess:
    """One process (CPU or one GPU): rank 0 of 1; every reduction is the identity."""

    rank = 0
    world = 1
    stops_at_step_boundary = False   # a signal stops the step at the next micro-batch
    optimizer_class = Muon
    balancer_reduce = None
    grad_scale = 1.0

    def configure(self, tc):
        return tc

    def barrier(self) -> None:
        pass

    def sum(self, values: Sequence[float]) -> list[float]:
        return list(values)

    def reduce_(self, t: torch.Tensor, op: str = "sum") -> torch.Tensor:
        check_reduce_op(op)
        return t

    def gather_objects(self, obj: Any) -> list:
        return [obj]

    def shard_batches(self, data, batch_size: int):
        return data

    def eval_rows(self, batch, batch_size: int):
        return tuple(batch)

    def parallelize(self, model: nn.Module, tc, model_config) -> None:
        pass

    def sync_grads(self, model: nn.Module) -> None:
        pass

    def clip_grad_norm_(self, model: nn.Module, max_norm: float) -> float:
        return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm).item()

    def save_checkpoint(self, run_dir: Path, step: int, model: nn.Module, optimizer, tokenizer,
                        trainer_state: Callable[[], dict], need_bytes: Callable[[], int]) -> Path:
        """``model/`` (safetensors), ``tokenizer.json``, ``optimizer.pt``, ``trainer_state.pt``,
        committed atomically (:mod:`k3.checkpoint.training`)."""
        def write(folder: Path) -> None:
            save_model_weights(model, folder / "model")
            if tokenizer is not None:
                tokenizer.save(folder / "tokenizer.json")
            torch.save(optimizer.state_dict(), folder / "optimizer.pt")
            torch.save(trainer_state(), folder / "trainer_state.pt")
        with RunLock(run_dir):  # re-entrant: a no-op while the trainer holds it
            return save_checkpoint(run_dir, step, write, need_bytes=need_bytes())

    def load_checkpoint(self, ckpt: Path, saved: dict, model: nn.Module, optimizer, model_config,
                        device: torch.device) -> None:
        if saved.get("format") == "dcp":   # Trainer(parallel=None) picks Distributed for these
            raise CheckpointError(f"{ckpt}: a distributed (DCP) checkpoint; resume it with k3 train "
                                  "--resume (torchrun or one process: it picks the distributed loader)")
        load_model_weights(model, ckpt / "model")
        optimizer.load_state_dict(torch.load(ckpt / "optimizer.pt", map_location=device, weights_only=True))

    def full_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        return model.state_dict()

    def param_count(self, model: nn.Module) -> int:
        return sum(p.numel() for p in model.parameters())
