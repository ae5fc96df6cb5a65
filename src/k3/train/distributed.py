"""Distributed training on torch.distributed (SPEC §5): DeviceMesh dp × ep, FSDP2, expert parallelism.

Launch: ``torchrun --nproc-per-node N -m k3 train --dp D --ep E ...`` (or ``k3 train --nproc N``,
which runs torchrun). Backend from the device: gloo on CPU, NCCL on CUDA; the code path is the same.

Layout of W = dp · ep ranks (rank = dp_index · ep + ep_index):

- data: every rank trains (and evaluates) on its own B/W rows of each global batch (expert parallelism borrows its
  ranks from data parallelism, as in DeepSpeed-MoE); all ranks keep the B row cursors, so the data
  state is one global object that resumes on any W.
- dense and attention parameters (everything but routed experts): FSDP2 ``fully_shard`` over all
  W ranks (per decoder layer, then the root); gradients are averaged over W by FSDP.
- routed experts: rank holds experts ep_index·E/ep …, replicated over dp; tokens reach them by
  all-to-all (``k3.train.expert_parallel``); their gradients are summed over dp and divided by W.
- the loss of a rank is the mean over its tokens; equal token counts per rank make the average of
  the W gradients the gradient of the global-batch mean, i.e. the single-process update.
- Quantile Balancing: margins are histogrammed on a grid that depends only on the (shared) bias;
  counts, histograms and dropped slots of all layers are summed in ONE all-reduce per step.
- Muon: a sharded [A, B] matrix is all-gathered, orthogonalized and re-sliced (each rank keeps its
  rows); a per-head matrix whose shard holds whole heads is orthogonalized locally (no traffic);
  expert stacks are local. The result equals the single-process update.
- checkpoints: ``torch.distributed.checkpoint`` (``k3.train.dist_checkpoint``), reloadable on
  another W; ``k3 convert`` turns one into the HF safetensors layout.
"""

from __future__ import annotations

import gc
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from k3.errors import ConfigError
from k3.train.expert_parallel import CommStats, ExpertParallel, shard_experts
from k3.train.loop import Trainer
from k3.train.optim import Muon, build_param_groups, orthogonalize

__all__ = ["Layout", "resolve_layout", "init_distributed", "DistTrainer", "ShardedMuon",
           "is_distributed_launch", "DEFAULT_DIST_QB_BINS"]

DEFAULT_DIST_QB_BINS = 1024


def is_distributed_launch() -> bool:
    """Whether this process was started by torchrun (WORLD_SIZE / RANK in the environment)."""
    return "WORLD_SIZE" in os.environ and "RANK" in os.environ


def resolve_layout(world: int, dp: int | None, ep: int, num_experts: int, batch_size: int) -> tuple[int, int]:
    """(dp, ep) for ``world`` ranks, or a ConfigError naming the field, raised before any step.

    dp None means world / ep. Needs world = dp·ep, num_experts % ep == 0 and batch_size % world == 0.
    """
    if world % ep:
        raise ConfigError(f"world size {world} is not divisible by ep={ep}")
    dp = world // ep if dp is None else dp
    if dp * ep != world:
        raise ConfigError(f"world size {world} does not match dp × ep = {dp} × {ep} = {dp * ep}; "
                          f"launch {dp * ep} processes or change --dp / --ep")
    if num_experts and num_experts % ep:
        raise ConfigError(f"num_experts={num_experts} is not divisible by ep={ep}")
    if ep > 1 and not num_experts:
        raise ConfigError(f"ep={ep} needs a model with routed experts (num_experts=0)")
    if batch_size % world:
        raise ConfigError(f"batch_size={batch_size} (the global batch) is not divisible by the "
                          f"world size {world}")
    return dp, ep


@dataclass
class Layout:
    """This process's place in the mesh."""

    world: int
    rank: int
    dp: int
    ep: int
    device: torch.device
    mesh: Any = None        # DeviceMesh ("dp", "ep")
    flat: Any = None        # DeviceMesh ("world",), what FSDP shards over

    @property
    def ep_rank(self) -> int:
        return self.rank % self.ep

    @property
    def ep_group(self):
        return self.mesh["ep"].get_group()

    @property
    def dp_group(self):
        return self.mesh["dp"].get_group()

    def rows(self, batch_size: int) -> slice:
        """This rank's rows of the global batch."""
        per = batch_size // self.world
        return slice(self.rank * per, (self.rank + 1) * per)


def init_distributed(tc, num_experts: int, rows: bool = True) -> Layout:
    """Start the process group (torchrun's env://, or a 1-rank group without torchrun), check the
    layout, build the meshes. The backend follows the device: cuda -> nccl, cpu -> gloo. ``rows``
    False: the run's data is not a batch of ``batch_size`` rows split over the ranks (an objective
    shares its own micro-batches out), so its divisibility is not checked."""
    from torch.distributed.device_mesh import init_device_mesh

    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    dp, ep = resolve_layout(world, tc.dp, tc.ep, num_experts, tc.batch_size if rows else world)
    if tc.qk_clip is not None:
        raise ConfigError("qk_clip is not supported in distributed runs (MLA weights are sharded)")
    if tc.qat:
        raise ConfigError("qat is not supported in distributed runs yet")
    device = torch.device(tc.device)
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    elif device.type != "cpu":
        raise ConfigError(f"device={tc.device!r}: distributed training runs on cpu (gloo) or cuda (nccl)")
    backend = "nccl" if device.type == "cuda" else "gloo"
    if not dist.is_initialized():
        if is_distributed_launch():
            dist.init_process_group(backend, device_id=device if backend == "nccl" else None)
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    mesh = init_device_mesh(device.type, (dp, ep), mesh_dim_names=("dp", "ep"))
    flat = init_device_mesh(device.type, (world,), mesh_dim_names=("world",))
    return Layout(world, rank, dp, ep, device, mesh, flat)


# ------------------------------------------------------------------------------- optimizer
def _shard_rows(n: int, world: int, rank: int) -> tuple[int, int]:
    """(offset, rows) of rank's Shard(0) piece of n rows (torch.chunk: pieces of ceil(n/W))."""
    size = -(-n // world)
    lo = min(rank * size, n)
    return lo, min(size, n - lo)


class ShardedMuon(Muon):
    """Muon + AdamW on FSDP2 DTensor shards and local expert shards, equal to the one-process update.

    Element-wise parts (momentum, AdamW moments, weight decay) act on each rank's shard as is.
    Orthogonalization needs the whole matrix (or one head block): a Shard(0) update is all-gathered,
    orthogonalized and re-sliced; if every row block of the shard is a whole head (block_rows
    divides the shard's offset and size) the blocks are orthogonalized in place. Every state tensor
    exists from the start (zeros, AdamW step 0: the same as a fresh state), so a checkpoint can
    always be loaded into it.
    """

    def __init__(self, params, **kwargs):
        super().__init__(params, **kwargs)
        self.gathers = 0  # matrices all-gathered per step (reported by the benchmark)
        for group in self.param_groups:
            for p in group["params"]:
                st = self.state[p]
                if group["use_muon"]:
                    st["momentum_buffer"] = torch.zeros_like(p)
                else:
                    st.update(step=0, exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))

    def _orthogonalize(self, u, group):
        from torch.distributed.tensor import DTensor, distribute_tensor
        if not isinstance(u, DTensor):
            return super()._orthogonalize(u, group)
        rows, steps = group["block_rows"], group["ns_steps"]
        mesh, placements = u.device_mesh, u.placements
        if rows is not None and u.ndim == 2:
            lo, n = _shard_rows(u.shape[0], mesh.size(), mesh.get_local_rank())
            if lo % rows == 0 and n % rows == 0:
                local = u.to_local()
                o = orthogonalize(local, rows, steps, self.ns_dtype)[0] if n else local.clone()
                return (DTensor.from_local(o, mesh, placements, shape=u.shape, stride=u.stride()),
                        (rows, u.shape[1]))
        self.gathers += 1
        o, shape = orthogonalize(u.full_tensor(), rows, steps, self.ns_dtype)
        return distribute_tensor(o, mesh, placements, src_data_rank=None), shape


# ---------------------------------------------------------------------------------- trainer
class _QuietMetrics:
    """Metrics of a rank other than 0: kept in memory (rank 0 writes metrics.jsonl)."""

    def __init__(self, records):
        self.records = list(records)

    def log(self, kind: str, **fields) -> dict:
        from k3.train.metrics import _json_safe
        rec = {"kind": kind, **{k: _json_safe(v) for k, v in fields.items()}}
        self.records.append(rec)
        return rec


class _NoLock:
    def release(self) -> None:
        pass


class _RankRows:
    """The global StridedBatches (all B cursors, the resumable state) cut to this rank's rows."""

    def __init__(self, batches, rows: slice):
        self.batches, self.rows = batches, rows

    def next_batch(self, seq_len: int):
        return tuple(t[self.rows] for t in self.batches.next_batch(seq_len))

    def state_dict(self):
        return self.batches.state_dict()

    def load_state_dict(self, state) -> None:
        self.batches.load_state_dict(state)


def _layout_config(tc, resume: bool, resolve):
    """The model config the mesh is laid out for: a resumed fine-tuning run's own (its ``init_from``
    checkpoint may be gone), else ``resolve(tc)``."""
    if resume and tc.init_from:
        from k3.config import K3Config
        from k3.train.state import find_checkpoint, load_trainer_state
        ckpt = find_checkpoint(tc.out)
        if ckpt is not None:
            return K3Config.from_dict(load_trainer_state(ckpt)["model_config"])
    return resolve(tc)


class DistTrainer(Trainer):
    """The Trainer on a dp × ep mesh; same records, same checkpoints semantics (module docstring).

    Collective calls per step besides FSDP's all-gathers / reduce-scatters and the all-to-alls: one
    all-reduce of the stop flag, one of the label count per step, one of the loss per micro-batch,
    one of the expert gradients over dp (one flat buffer), one of the squared gradient norm, one of
    the router statistics.
    """

    def __init__(self, tc, resume: bool = False, print_fn=print, tty: bool | None = None,
                 overwrite: bool = False, **kwargs):
        from k3.train.config import resolve_model_config
        from k3.train.runinfo import absolute_paths

        tc = absolute_paths(tc)
        self.layout = init_distributed(tc, _layout_config(tc, resume, resolve_model_config).num_experts,
                                       rows=kwargs.get("objective") is None)
        self.comm = CommStats()
        self._pending_signal: int | None = None
        rank0 = self.layout.rank == 0
        if not rank0:
            self.progress_stream = open(os.devnull, "w")
            tc = tc.replace(plot=False)
        if tc.qb_bins is None and tc.balance == "quantile":
            tc = tc.replace(qb_bins=DEFAULT_DIST_QB_BINS)
        super().__init__(tc, resume, print_fn if rank0 else (lambda *a, **k: None),
                         tty if rank0 else False, overwrite, **kwargs)

    # ------------------------------------------------------------------ seams of Trainer
    def _open_run_dir(self, resume: bool):
        lock = super()._open_run_dir(resume) if self.layout.rank == 0 else _NoLock()
        dist.barrier()
        return lock

    def _checkpoint_to_resume(self, resume: bool, overwrite: bool):
        from k3.train.state import find_checkpoint, load_trainer_state
        out = super()._checkpoint_to_resume(resume, overwrite) if self.layout.rank == 0 else (None, None)
        dist.barrier()  # rank 0 has claimed / marked the folder
        if self.layout.rank == 0 or not resume:
            return out
        ckpt = find_checkpoint(self.run_dir)
        return ckpt, load_trainer_state(ckpt)

    def _build_data(self, ckpt, saved) -> None:
        if self.layout.rank != 0:
            dist.barrier()  # rank 0 fills the tokenizer / token caches first
        super()._build_data(ckpt, saved)
        if self.layout.rank == 0:
            dist.barrier()
        if self.objective is None:   # an objective shares its micro-batches out itself (rank, world)
            self.data = _RankRows(self.data, self.layout.rows(self.tc.batch_size))

    def _parallelize(self) -> None:
        from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method
        if self.model_config.vision_config is not None:
            raise ConfigError("a model with a vision tower trains in one process for now: drop --nproc "
                              "(sharding the tower and splitting a batch's images by rank are not built)")
        lay = self.layout
        self.expert_params: list[nn.Parameter] = []
        for moe in self.model.moe_layers():
            if lay.ep > 1:
                shard_experts(moe, lay.ep_rank, lay.ep)
                moe.dispatcher = ExpertParallel(lay.ep_group, self.tc.capacity_factor, self.comm)
            self.expert_params += [moe.experts.w1, moe.experts.w2, moe.experts.w3]
        ignored = set(self.expert_params)
        for layer in self.model.model.layers:
            fully_shard(layer, mesh=lay.flat, ignored_params=ignored)
            register_fsdp_forward_method(layer, "forward_attn_res")  # AttnRes calls it, not forward
        fully_shard(self.model, mesh=lay.flat, ignored_params=ignored)
        self.expert_names = {id(p): n for n, p in self.model.named_parameters() if p in ignored}

    def _make_optimizer(self):
        tc = self.tc
        from k3.train.loop import _NS_DTYPES, _OPTIMIZER_MODES
        groups = build_param_groups(self.model, self.model_config, tc.lr, tc.weight_decay,
                                    _OPTIMIZER_MODES[tc.optimizer])
        return ShardedMuon(groups, lr=tc.lr, weight_decay=tc.weight_decay, ns_dtype=_NS_DTYPES[tc.ns_dtype])

    def _make_balancer(self):
        from k3.train.balance import RouterBalancer
        return RouterBalancer(self.model, self.tc.balance, self.tc.balance_rate, bins=self.tc.qb_bins,
                              reduce=lambda t: dist.all_reduce(t))

    def _make_metrics(self, records):
        return super()._make_metrics(records) if self.layout.rank == 0 else _QuietMetrics(records)

    def _write_run_info(self, resumed_from):
        if self.layout.rank == 0:
            super()._write_run_info(resumed_from)

    def _load_weights_and_optimizer(self, ckpt: Path, saved: dict) -> None:
        from k3.train.dist_checkpoint import load_sharded
        load_sharded(self, ckpt, saved)

    def save(self) -> Path:
        from k3.train.dist_checkpoint import save_sharded
        path = save_sharded(self)
        self.last_saved_step = self.step
        return path

    def _sum_over_ranks(self, value: float) -> float:
        t = torch.tensor([value], dtype=torch.float64, device=self.layout.device)
        dist.all_reduce(t)
        return float(t)

    @property
    def rank(self) -> int:
        return self.layout.rank

    @property
    def world(self) -> int:
        return self.layout.world

    def gather_objects(self, obj):
        out = [None] * self.layout.world
        dist.all_gather_object(out, obj)
        return out

    def reduce_(self, t: torch.Tensor, op: str = "sum") -> torch.Tensor:
        ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}
        if op not in ops:
            raise ValueError(f"reduce_: op must be 'sum' or 'max', got {op!r}")
        dist.all_reduce(t, op=ops[op])
        return t

    def stop_requested(self):
        return self.stop_signal if self.stop_signal is not None else self._pending_signal

    @torch.no_grad()
    def full_model_state(self) -> dict[str, torch.Tensor]:
        """Collective: FSDP shards all-gathered, expert shards gathered over ep (replicated over dp)."""
        from torch.distributed.fsdp import FSDPModule
        from torch.distributed.tensor import DTensor

        from k3.train.dist_checkpoint import _wrap_expert
        for m in self.model.modules():  # an eval forward leaves the root's parameters gathered
            if isinstance(m, FSDPModule):
                m.reshard()
        experts = {n for n, p in self.model.named_parameters() if any(p is e for e in self.expert_params)}
        out = {}
        for name, t in self.model.state_dict().items():   # the same order on every rank
            if name in experts and self.layout.ep > 1:
                t = _wrap_expert(self, t.detach()).full_tensor()
            elif isinstance(t, DTensor):
                t = t.full_tensor()
            out[name] = t.detach().clone()
        return out

    def _grad_scale(self) -> float:
        """FSDP and the expert sync average gradients over the W processes: scale by W."""
        return float(self.layout.world)

    def _eval_part(self, x, y, *rest):
        """Rank's rows of a validation batch; a short last batch is padded to B rows (inputs 0,
        labels ignored, packed documents 0) so every rank runs the same shapes through the
        collectives."""
        from k3.data.packing import IGNORE_INDEX
        b = self.tc.batch_size
        if x.shape[0] < b:
            pad = b - x.shape[0]
            x = torch.cat([x, x.new_zeros(pad, x.shape[1])])
            y = torch.cat([y, y.new_full((pad, y.shape[1]), IGNORE_INDEX)])
            rest = tuple(torch.cat([d, d.new_zeros(pad, d.shape[1])]) for d in rest)
        rows = self.layout.rows(b)
        return (x[rows], y[rows], *(d[rows] for d in rest))

    def _sum_eval(self, nats: float, ntok: int, nbytes: int):
        t = torch.tensor([nats, ntok, nbytes], dtype=torch.float64, device=self.layout.device)
        dist.all_reduce(t)
        return float(t[0]), int(t[1]), int(t[2])

    @torch.no_grad()
    def _sync_grads(self) -> None:
        """Expert gradients: sum over dp (one flat buffer), divide by W (module docstring)."""
        grads = [p.grad for p in self.expert_params if p.grad is not None]
        if not grads:
            return
        flat = torch.cat([g.reshape(-1) for g in grads])
        if self.layout.dp > 1:
            dist.all_reduce(flat, group=self.layout.dp_group)
        flat.div_(self.layout.world)
        off = 0
        for g in grads:
            g.copy_(flat[off:off + g.numel()].view_as(g))
            off += g.numel()

    @torch.no_grad()
    def _clip_grad_norm(self, max_norm: float) -> float:
        """Global L2 norm: shard squares (experts / dp: they are replicated dp times), one all-reduce."""
        from torch.distributed.tensor import DTensor
        sq = torch.zeros((), dtype=torch.float64, device=self.layout.device)
        experts = set(id(p) for p in self.expert_params)
        grads = []
        for p in self.model.parameters():
            if p.grad is None:
                continue
            g = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            grads.append(g)
            s = g.double().pow(2).sum()
            sq += s / self.layout.dp if id(p) in experts else s
        dist.all_reduce(sq)
        total = math.sqrt(float(sq))
        coef = max_norm / (total + 1e-6)
        if coef < 1.0:
            for g in grads:
                g.mul_(coef)
        return total

    # ------------------------------------------------------------------ signals and steps
    def _handle_signal(self, signum, frame) -> None:
        if self.stop_signal is not None:
            raise KeyboardInterrupt
        self._pending_signal = signum  # acted on at the next step boundary, on every rank at once

    def train_step(self) -> dict:
        flag = torch.tensor([self._pending_signal or 0], device=self.layout.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if int(flag) and self.stop_signal is None:
            self.stop_signal = int(flag)
            return {"kind": "stopped", "step": self.step}
        return super().train_step()


def destroy() -> None:
    """Tear the process group down (end of a distributed ``k3 train``).

    ``destroy_process_group`` only unregisters the group; the gloo group itself, and its worker
    threads, live on while a Python object refers to it (an ``ExpertParallel`` dispatcher in a module
    cycle does). If they live into interpreter finalization, a worker thread that drops a finished
    work item (a barrier that holds an all-to-all's tensors) must take the GIL to free those
    tensors' Python objects, and a thread that takes the GIL during finalization exits in the middle
    of a C++ destructor: ``terminate called without an active exception`` (SIGABRT), after the run's
    results were written (seen in core dumps of the distributed tests, ~1 run in 10). Collecting the
    cycles here frees the group while the interpreter is whole: its destructor releases the GIL and
    joins its threads."""
    if dist.is_initialized():
        dist.destroy_process_group()
        gc.collect()
