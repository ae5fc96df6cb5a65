"""What a training forward measures, returned by the forward (SPEC §1: no flags on modules).

``model(x, stats=ForwardStats())`` fills the object as the layers run and hands it back as
``CausalLMOutput.stats``; a forward without one measures nothing, so inference pays nothing.

    router[moe]        RouterStats of each LatentMoE the forward ran:
                         scores  [N, E] fp32 sigmoid router scores (detached, before the bias)
                         counts  [E] int64 slots routed per expert (before any capacity drop)
                         dropped slots past capacity (int; None on the dropless path)
    max_logits[mla]    [nh] fp32 largest pre-softmax score per head of each GatedMLA
                       (only with ``max_logits=True``: it costs a pass over the scores)

Entries are keyed by the layer module (the consumers, Quantile Balancing and QK-Clip, hold the
layers whose weights they change). A layer that runs more than once in one forward (the token
mixer over each packed document) accumulates: scores concatenated, counts and drops added, max
logits maxed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["ForwardStats", "RouterStats"]


@dataclass
class RouterStats:
    scores: torch.Tensor             # [N, E] fp32, detached
    counts: torch.Tensor             # [E] int64
    dropped: int | None = None       # capacity path / expert parallelism: slots dropped


class ForwardStats:
    """The statistics one forward measured (module docstring). A plain object on purpose: wrappers
    that move a forward's tensor arguments (FSDP) pass it through untouched."""

    def __init__(self, max_logits: bool = False):
        self.measure_max_logits = bool(max_logits)
        self.router: dict[nn.Module, RouterStats] = {}
        self.max_logits: dict[nn.Module, torch.Tensor] = {}

    def add_router(self, layer: nn.Module, scores: torch.Tensor, counts: torch.Tensor,
                   dropped: int | None) -> None:
        old = self.router.get(layer)
        if old is None:
            self.router[layer] = RouterStats(scores, counts, dropped)
            return
        drops = None if old.dropped is None and dropped is None else (old.dropped or 0) + (dropped or 0)
        self.router[layer] = RouterStats(torch.cat([old.scores, scores]), old.counts + counts, drops)

    def add_max_logits(self, layer: nn.Module, m: torch.Tensor) -> None:
        old = self.max_logits.get(layer)
        self.max_logits[layer] = m if old is None else torch.maximum(old, m)

    def __repr__(self) -> str:
        return (f"ForwardStats(router={len(self.router)} layers, max_logits={len(self.max_logits)} layers"
                f"{'' if self.measure_max_logits else ', not measured'})")
