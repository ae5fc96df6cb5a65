"""Distributed training on torch.distributed (SPEC §5): DeviceMesh dp × ep, FSDP2, expert parallelism.

Launch: ``torchrun --nproc-per-node N -m k3 train --dp D --ep E ...`` (or ``k3 train --nproc N``,
which runs torchrun). Backend from the device: gloo on CPU, NCCL on CUDA; the code path is the same.

Layout of W = dp · ep ranks (rank = dp_index · ep + ep_index):

- data: every rank trains (and evaluates) on its own B/W rows of each global batch (expert parallelism borrows its
  ranks from data parallelism, as in DeepSpeed-MoE); all ranks keep the B row cursors, so the data
  state is one global object that resumes on any W.
- dense and attention parameters (everything but routed experts): FSDP2 ``fully_shard`` over all
  W ranks (per decoder layer, then the root); gradients are averaged over W by FSDP.
- a vision model's tower and projector: whole on every rank (not sharded); a rank embeds the
  images of its own rows (``k3.model.multimodal.images_of_rows``); their gradients are summed
  over W (zeros on a rank without images) and divided by W.
- routed experts: rank holds experts ep_index·E/ep …, replicated over dp; tokens reach them by
  all-to-all (``k3.train.expert_parallel``); their gradients are summed over dp and divided by W.
- the loss of a rank is the mean over its tokens; equal token counts per rank make the average of
  the W gradients the gradient of the global-batch mean, i.e. the single-process update.
- Quantile Balancing: margins are histogrammed on a grid that depends only on the (shared) bias;
  counts, histograms and dropped slots of all layers are summed in ONE all-reduce per step.
- Muon: a sharded [A, B] matrix is all-gathered, orthogonalized and re-sliced (each rank keeps its
  rows); a per-head matrix whose shard holds whole heads is orthogonalized locally (no traffic);
  expert stacks are local. The result equals the single-process update.
- checkpoints: ``torch.distributed.checkpoint`` (:mod:`k3.checkpoint.dcp`), reloadable on
  another W; ``k3 convert`` turns one into the HF safetensors layout.

:class:`Distributed` is this layout as the one Trainer's parallelism object (``k3.train.parallel``);
``Trainer(tc)`` picks it under torchrun (``parallel_for``).
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
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method
from torch.distributed.tensor import DTensor, distribute_tensor

from k3.checkpoint.dcp import expert_dtensor, load_sharded, reshard, save_sharded
from k3.checkpoint.training import find_checkpoint, load_trainer_state
from k3.config import K3Config
from k3.data.packing import IGNORE_INDEX
from k3.errors import ConfigError
from k3.model.multimodal import K3VLForConditionalGeneration, images_of_rows
from k3.train.config import resolve_model_config
from k3.train.expert_parallel import CommStats, ExpertParallel, shard_experts
from k3.train.optim import Muon, orthogonalize
from k3.train.parallel import Parallelism, SingleProcess, check_reduce_op

__all__ = ["Layout", "resolve_layout", "init_distributed", "Distributed", "parallel_for", "ShardedMuon",
           "is_distributed_launch", "destroy", "DEFAULT_DIST_QB_BINS"]

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


# ------------------------------------------------------------------------------ parallelism
class _RankRows:
    """The global batches (all B cursors, the resumable state) cut to this rank's rows (and, for a
    vision model's batch, to those rows' images: ``Distributed.rows_of``)."""

    def __init__(self, batches, rows: slice, parallel: "Distributed"):
        self.batches, self.rows, self.parallel = batches, rows, parallel

    def next_batch(self, seq_len: int):
        return self.parallel.rows_of(self.batches.next_batch(seq_len), self.rows)

    def state_dict(self):
        return self.batches.state_dict()

    def load_state_dict(self, state) -> None:
        self.batches.load_state_dict(state)


def _layout_config(tc, resume: bool) -> K3Config:
    """The model config the mesh is laid out for: a resumed fine-tuning run's own (its ``init_from``
    checkpoint may be gone), else the run's (``resolve_model_config``)."""
    if resume and tc.init_from:
        ckpt = find_checkpoint(tc.out)
        if ckpt is not None:
            return K3Config.from_dict(load_trainer_state(ckpt)["model_config"])
    return resolve_model_config(tc)


def _is_dcp_run(run_dir) -> bool:
    ckpt = find_checkpoint(run_dir)
    return ckpt is not None and load_trainer_state(ckpt).get("format") == "dcp"


def parallel_for(tc, resume: bool = False, rows: bool = True) -> Parallelism:
    """The layout a run trains with: :class:`Distributed` under torchrun, or to resume a run whose
    checkpoint is distributed (DCP; a 1-rank group without torchrun), else one process. ``rows``
    False: an objective shares its own micro-batches out (``init_distributed``)."""
    if is_distributed_launch() or (resume and _is_dcp_run(tc.out)):
        return Distributed.launch(tc, resume, rows)
    return SingleProcess()


class Distributed:
    """The dp × ep layout of the module docstring, as the Trainer's parallelism object
    (:class:`k3.train.parallel.Parallelism`): same records, same checkpoint semantics as one process.

    Collective calls per step besides FSDP's all-gathers / reduce-scatters and the all-to-alls: one
    all-reduce of the stop flag, one of the label count per step, one of the loss per micro-batch,
    one of the expert gradients over dp (one flat buffer), one of the squared gradient norm, one of
    the router statistics.
    """

    stops_at_step_boundary = True   # every rank acts on a stop signal at the same step boundary
    optimizer_class = ShardedMuon

    def __init__(self, layout: Layout):
        self.layout = layout
        self.comm = CommStats()     # the all-to-all traffic of expert parallelism
        self.expert_params: list[nn.Parameter] = []
        self.replicated_params: list[nn.Parameter] = []   # a vision tower and projector: whole on every rank
        self._media: tuple[int, list[int]] | None = None  # (<|media_pad|> id, merge kernel) of a vision model

    @classmethod
    def launch(cls, tc, resume: bool = False, rows: bool = True) -> "Distributed":
        """Start the process group and lay out the mesh for ``tc`` (``init_distributed``)."""
        return cls(init_distributed(tc, _layout_config(tc, resume).num_experts, rows=rows))

    @property
    def rank(self) -> int:
        return self.layout.rank

    @property
    def world(self) -> int:
        return self.layout.world

    @property
    def grad_scale(self) -> float:
        """FSDP and the expert sync average gradients over the W processes: scale by W."""
        return float(self.layout.world)

    @property
    def balancer_reduce(self):
        return lambda t: dist.all_reduce(t)

    def configure(self, tc):
        """Only rank 0 plots; Quantile Balancing pools histograms (``qb_bins``, default 1024)."""
        if self.rank != 0:
            tc = tc.replace(plot=False)
        if tc.qb_bins is None and tc.balance == "quantile":
            tc = tc.replace(qb_bins=DEFAULT_DIST_QB_BINS)
        return tc

    def barrier(self) -> None:
        dist.barrier()

    def sum(self, values) -> list[float]:
        t = torch.tensor(list(values), dtype=torch.float64, device=self.layout.device)
        dist.all_reduce(t)
        return t.tolist()

    def reduce_(self, t: torch.Tensor, op: str = "sum") -> torch.Tensor:
        check_reduce_op(op)
        dist.all_reduce(t, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op])
        return t

    def gather_objects(self, obj) -> list:
        out = [None] * self.layout.world
        dist.all_gather_object(out, obj)
        return out

    def shard_batches(self, data, batch_size: int):
        return _RankRows(data, self.layout.rows(batch_size), self)

    def rows_of(self, batch, rows: slice) -> tuple[torch.Tensor, ...]:
        """``rows`` of a batch; a vision batch (input_ids, labels, doc_ids, pixel_values, grid_thws)
        keeps the images of those rows only (``images_of_rows``)."""
        if len(batch) == 5 and self._media is not None:
            x, y, d, pixels, grid = batch
            pixels, grid = images_of_rows(x, pixels, grid, rows, *self._media)
            return x[rows], y[rows], d[rows], pixels, grid
        return tuple(t[rows] for t in batch)

    def eval_rows(self, batch, batch_size: int):
        """Rank's rows of a validation batch; a short last batch is padded to B rows (inputs 0,
        labels ignored, packed documents 0) so every rank runs the same shapes through the
        collectives."""
        x, y, *rest = batch
        images = rest[1:] if len(rest) == 3 else []   # a vision batch: pixel_values, grid_thws
        rest = rest[:1] if images else rest
        if x.shape[0] < batch_size:
            pad = batch_size - x.shape[0]
            x = torch.cat([x, x.new_zeros(pad, x.shape[1])])
            y = torch.cat([y, y.new_full((pad, y.shape[1]), IGNORE_INDEX)])
            rest = [torch.cat([d, d.new_zeros(pad, d.shape[1])]) for d in rest]
        return self.rows_of((x, y, *rest, *images), self.layout.rows(batch_size))

    def parallelize(self, model: nn.Module, tc, model_config) -> None:
        """Routed experts spread over ep (all-to-all dispatch), everything else of the text model
        FSDP2-sharded over W. A vision tower and its projector stay whole on every rank (each rank
        embeds its own rows' images, and a rank whose rows hold none does not run the tower, which
        FSDP's per-module collectives would not allow); ``sync_grads`` averages their gradients."""
        lay = self.layout
        text = model
        if isinstance(model, K3VLForConditionalGeneration):
            text = model.language_model
            self.replicated_params = [*model.vision_tower.parameters(), *model.mm_projector.parameters()]
            self._media = (model.media_pad_token_id, list(model.vision_config.merge_kernel_size))
        self.expert_params = []
        for moe in model.moe_layers():
            if lay.ep > 1:
                shard_experts(moe, lay.ep_rank, lay.ep)
                moe.dispatcher = ExpertParallel(lay.ep_group, tc.capacity_factor, self.comm)
            self.expert_params += [moe.experts.w1, moe.experts.w2, moe.experts.w3]
        ignored = set(self.expert_params) | set(self.replicated_params)
        for layer in text.model.layers:
            fully_shard(layer, mesh=lay.flat, ignored_params=ignored)
            register_fsdp_forward_method(layer, "forward_attn_res")  # AttnRes calls it, not forward
        fully_shard(model, mesh=lay.flat, ignored_params=ignored)

    @torch.no_grad()
    def sync_grads(self, model: nn.Module) -> None:
        """Expert gradients: sum over dp (one flat buffer), divide by W (module docstring)."""
        self._sync_replicated()
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

    def _sync_replicated(self) -> None:
        """The vision tower's gradients: summed over all W ranks (zeros where a rank's rows held no
        image), divided by W, as FSDP averages the sharded ones."""
        params = [p for p in self.replicated_params if p.requires_grad]   # --freeze-vision: none
        if not params:
            return
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        dist.all_reduce(flat)
        flat.div_(self.layout.world)
        off = 0
        for p in params:
            p.grad.copy_(flat[off:off + p.numel()].view_as(p.grad))
            off += p.numel()

    @torch.no_grad()
    def clip_grad_norm_(self, model: nn.Module, max_norm: float) -> float:
        """Global L2 norm: shard squares (experts / dp: they are replicated dp times), one all-reduce."""
        sq = torch.zeros((), dtype=torch.float64, device=self.layout.device)
        experts = set(id(p) for p in self.expert_params)
        whole = set(id(p) for p in self.replicated_params)   # the same gradient on every rank
        grads = []
        for p in model.parameters():
            if p.grad is None:
                continue
            g = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            grads.append(g)
            s = g.double().pow(2).sum()
            sq += s / self.layout.dp if id(p) in experts else s / self.layout.world if id(p) in whole else s
        dist.all_reduce(sq)
        total = math.sqrt(float(sq))
        coef = max_norm / (total + 1e-6)
        if coef < 1.0:
            for g in grads:
                g.mul_(coef)
        return total

    def save_checkpoint(self, run_dir: Path, step: int, model: nn.Module, optimizer, tokenizer,
                        trainer_state, need_bytes) -> Path:
        """Collective: DCP shards of every rank; rank 0 commits them with the tokenizer and the
        trainer state (+ ``"format": "dcp"`` and the layout; :mod:`k3.checkpoint.dcp`)."""
        lay = self.layout

        def write_rest(folder: Path) -> None:
            info = {**trainer_state(), "format": "dcp", "world_size": lay.world, "dp": lay.dp, "ep": lay.ep}
            if tokenizer is not None:
                tokenizer.save(folder / "tokenizer.json")
            torch.save(info, folder / "trainer_state.pt")

        return save_sharded(run_dir, step, model, optimizer, self.expert_params, lay.mesh, lay.rank,
                            write_rest, need_bytes)

    def load_checkpoint(self, ckpt: Path, saved: dict, model: nn.Module, optimizer, model_config,
                        device: torch.device) -> None:
        load_sharded(ckpt, saved, model, optimizer, self.expert_params, self.layout.mesh, model_config)

    @torch.no_grad()
    def full_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """Collective: FSDP shards all-gathered, expert shards gathered over ep (replicated over dp)."""
        reshard(model)   # an eval forward leaves the root's parameters gathered
        experts = {n for n, p in model.named_parameters() if any(p is e for e in self.expert_params)}
        out = {}
        for name, t in model.state_dict().items():   # the same order on every rank
            if name in experts and self.layout.ep > 1:
                t = expert_dtensor(self.layout.mesh, t.detach()).full_tensor()
            elif isinstance(t, DTensor):
                t = t.full_tensor()
            out[name] = t.detach().clone()
        return out

    def param_count(self, model: nn.Module) -> int:
        """Model parameters (global: an expert-parallel rank holds 1/ep of the routed experts)."""
        n = sum(p.numel() for p in model.parameters())
        return n + (self.layout.ep - 1) * sum(p.numel() for p in self.expert_params)


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
