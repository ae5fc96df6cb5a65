"""The program torchrun starts in the distributed tests: ``dist_worker.py MODE OUT [k3 train args]``.

Modes:
- ``train``: ``k3 train`` with the given arguments; with K3_TEST_KILL_RANK / K3_TEST_KILL_STEP set,
  that rank SIGKILLs itself at the start of that step (0-based), as a crashed node would.
- ``dispatch``: one nano LatentMoE per rank (same seed), experts spread over all ranks; this rank
  routes its slice of a fixed token batch through the all-to-all dispatcher; saves the output, the
  dropped slots and the gradients of its local experts to OUT/rank<r>.pt.
- ``qb``: the same MoE; each rank's slice goes through the router, and a RouterBalancer with a SUM
  all-reduce installs the pooled-histogram bias; saves it to OUT/rank<r>.pt.
- ``muon``: ShardedMuon on FSDP2 shards against Muon on full tensors; saves the deviation.
"""

import os
import signal
import sys

import torch
import torch.distributed as dist

N_TOKENS, BINS = 64, 4096


def _moe_and_tokens(seed: int = 0):
    from k3.model.moe import LatentMoE
    from k3.config.presets import get_preset
    torch.manual_seed(seed)
    cfg = get_preset("nano")
    moe = LatentMoE(cfg)
    x = torch.randn(N_TOKENS, cfg.hidden_size)
    return moe, x


def _rows(world: int, rank: int) -> slice:
    per = N_TOKENS // world
    return slice(rank * per, (rank + 1) * per)


def dispatch(out: str, capacity_factor: float | None) -> None:
    from k3.model.stats import ForwardStats
    from k3.train.expert_parallel import CommStats, ExpertParallel, shard_experts
    world, rank = dist.get_world_size(), dist.get_rank()
    moe, x = _moe_and_tokens()
    shard_experts(moe, rank, world)
    stats = CommStats()
    moe.dispatcher = ExpertParallel(dist.group.WORLD, capacity_factor, stats)
    fs = ForwardStats()
    xs = x[_rows(world, rank)].clone().requires_grad_(True)
    y = moe(xs, stats=fs)
    torch.manual_seed(1)
    probe = torch.randn(N_TOKENS, y.shape[-1])[_rows(world, rank)]
    (y * probe).sum().backward()
    torch.save({"y": y.detach(), "dropped": int(fs.router[moe].dropped), "bytes": stats.bytes,
                "calls": stats.calls, "w1_grad": moe.experts.w1.grad, "x_grad": xs.grad},
               os.path.join(out, f"rank{rank}.pt"))


def qb_moe_and_tokens():
    """The MoE with a 20x sharper router (scores spread over (0, 1)) and a non-zero bias."""
    moe, x = _moe_and_tokens()
    with torch.no_grad():
        moe.gate.weight.mul_(20)
        moe.gate.e_score_correction_bias.copy_(torch.linspace(-0.05, 0.05, moe.num_experts))
    return moe, x


def qb(out: str) -> None:
    from k3.model.stats import ForwardStats
    from k3.train.balance import RouterBalancer
    world, rank = dist.get_world_size(), dist.get_rank()
    moe, x = qb_moe_and_tokens()
    bal = RouterBalancer([moe], "quantile", bins=BINS, reduce=lambda t: dist.all_reduce(t))
    fs = ForwardStats()
    with torch.no_grad():
        moe(x[_rows(world, rank)], stats=fs)
    bal.collect(fs)
    bal.update()
    torch.save({"bias": moe.gate.e_score_correction_bias.clone()}, os.path.join(out, f"rank{rank}.pt"))


def muon(out: str) -> None:
    """Three ShardedMuon steps on FSDP2 shards vs Muon on the full tensors (both in this rank).

    Over 4 ranks: ``a`` [10, 12] full-matrix Muon (uneven shards of 3 rows: gathered), ``q`` [16, 12]
    per-head with 4-row heads (one head per shard: orthogonalized in place), ``k`` [12, 8] per-head
    with 6-row heads (shards of 3 rows split heads: gathered), ``v`` [7] AdamW.
    """
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import distribute_tensor

    from k3.train.distributed import ShardedMuon
    from k3.train.optim import Muon
    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    shapes = {"a": (10, 12), "q": (16, 12), "k": (12, 8), "v": (7,)}
    init = {n: torch.randn(*s) for n, s in shapes.items()}
    grads = [{n: torch.randn(*s) for n, s in shapes.items()} for _ in range(3)]

    def groups(ps):
        return [dict(params=[ps["a"]], use_muon=True, block_rows=None),
                dict(params=[ps["q"]], use_muon=True, block_rows=4),
                dict(params=[ps["k"]], use_muon=True, block_rows=6),
                dict(params=[ps["v"]], use_muon=False, block_rows=None)]

    ref = {n: nn.Parameter(t.clone()) for n, t in init.items()}
    m = nn.Module()
    for n, t in init.items():
        m.register_parameter(n, nn.Parameter(t.clone()))
    fully_shard(m, mesh=mesh)
    sharded = dict(m.named_parameters())
    # fp32 Newton-Schulz: a bf16 one (the default) of a shard's blocks rounds unlike the whole batch's
    opt_ref = Muon(groups(ref), lr=0.02, weight_decay=0.1, ns_dtype=torch.float32)
    opt = ShardedMuon(groups(sharded), lr=0.02, weight_decay=0.1, ns_dtype=torch.float32)
    for g in grads:
        for n in shapes:
            ref[n].grad = g[n].clone()
            sharded[n].grad = distribute_tensor(g[n].clone(), mesh, sharded[n].placements)
        opt_ref.step()
        opt.step()
    dev = max((sharded[n].full_tensor() - ref[n]).abs().max().item() for n in shapes)
    moved = min((ref[n] - init[n]).abs().max().item() for n in shapes)
    torch.save({"dev": dev, "moved": moved, "gathers": opt.gathers}, os.path.join(out, f"rank{rank}.pt"))


def train(argv: list[str]) -> int:
    from k3.cli.train import train_main
    kill_rank, kill_step = os.environ.get("K3_TEST_KILL_RANK"), os.environ.get("K3_TEST_KILL_STEP")

    def hook(trainer):
        if kill_rank is not None and int(kill_rank) == trainer.rank:
            def die(tr, step):
                if step == int(kill_step):
                    os.kill(os.getpid(), signal.SIGKILL)
            trainer.on_step_start.append(die)

    return train_main(argv, trainer_hook=hook)


if __name__ == "__main__":
    mode, out = sys.argv[1], sys.argv[2]
    if mode == "train":
        sys.exit(train(sys.argv[3:]))
    from k3.train.distributed import destroy

    dist.init_process_group("gloo")
    try:
        if mode == "dispatch":
            dispatch(out, None if sys.argv[3] == "none" else float(sys.argv[3]))
        elif mode == "qb":
            qb(out)
        elif mode == "muon":
            muon(out)
        else:
            raise SystemExit(f"unknown mode {mode}")
        dist.barrier()   # every rank's collectives done before any rank tears its group down
    finally:
        destroy()        # k3's teardown: the group freed before interpreter finalization
