"""The program torchrun starts in the distributed tests: ``dist_worker.py MODE OUT [k3 train args]``.

Modes:
- ``train``: ``k3 train`` with the given arguments; with K3_TEST_KILL_RANK / K3_TEST_KILL_STEP set,
  that rank SIGKILLs itself at the start of that step (0-based), as a crashed node would.
- ``dispatch``: one nano LatentMoE per rank (same seed), experts spread over all ranks; this rank
  routes its slice of a fixed token batch through the all-to-all dispatcher; saves the output, the
  dropped slots and the gradients of its local experts to OUT/rank<r>.pt.
- ``qb``: the same MoE; each rank's slice goes through the router, and a RouterBalancer with a SUM
  all-reduce installs the pooled-histogram bias; saves it to OUT/rank<r>.pt.
"""

import os
import signal
import sys

import torch
import torch.distributed as dist

N_TOKENS, BINS = 64, 4096


def _moe_and_tokens(seed: int = 0):
    from k3.model.moe import LatentMoE
    from k3.presets import get_preset
    torch.manual_seed(seed)
    cfg = get_preset("nano")
    moe = LatentMoE(cfg)
    x = torch.randn(N_TOKENS, cfg.hidden_size)
    return moe, x


def _rows(world: int, rank: int) -> slice:
    per = N_TOKENS // world
    return slice(rank * per, (rank + 1) * per)


def dispatch(out: str, capacity_factor: float | None) -> None:
    from k3.train.expert_parallel import CommStats, ExpertParallel, shard_experts
    world, rank = dist.get_world_size(), dist.get_rank()
    moe, x = _moe_and_tokens()
    shard_experts(moe, rank, world)
    stats = CommStats()
    moe.dispatcher = ExpertParallel(dist.group.WORLD, capacity_factor, stats)
    moe.record_router_stats = True
    xs = x[_rows(world, rank)].clone().requires_grad_(True)
    y = moe(xs)
    torch.manual_seed(1)
    probe = torch.randn(N_TOKENS, y.shape[-1])[_rows(world, rank)]
    (y * probe).sum().backward()
    torch.save({"y": y.detach(), "dropped": int(moe.last_dropped), "bytes": stats.bytes,
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
    from k3.train.balance import RouterBalancer
    world, rank = dist.get_world_size(), dist.get_rank()
    moe, x = qb_moe_and_tokens()
    bal = RouterBalancer([moe], "quantile", bins=BINS, reduce=lambda t: dist.all_reduce(t))
    bal.recording(True)
    with torch.no_grad():
        moe(x[_rows(world, rank)])
    bal.collect()
    bal.update()
    torch.save({"bias": moe.gate.e_score_correction_bias.clone()}, os.path.join(out, f"rank{rank}.pt"))


def train(argv: list[str]) -> int:
    from k3.train.commands import train_main
    kill_rank, kill_step = os.environ.get("K3_TEST_KILL_RANK"), os.environ.get("K3_TEST_KILL_STEP")

    def hook(trainer):
        if kill_rank is not None and int(kill_rank) == trainer.layout.rank:
            def die(tr, step):
                if step == int(kill_step):
                    os.kill(os.getpid(), signal.SIGKILL)
            trainer.on_step_start.append(die)

    return train_main(argv, trainer_hook=hook)


if __name__ == "__main__":
    mode, out = sys.argv[1], sys.argv[2]
    if mode == "train":
        sys.exit(train(sys.argv[3:]))
    dist.init_process_group("gloo")
    try:
        if mode == "dispatch":
            dispatch(out, None if sys.argv[3] == "none" else float(sys.argv[3]))
        elif mode == "qb":
            qb(out)
        else:
            raise SystemExit(f"unknown mode {mode}")
    finally:
        dist.destroy_process_group()
