"""Router-bias balancing in the training loop (SPEC §3.6): Quantile Balancing or the sign update.

Timeline of one optimizer step t (with grad accumulation over micro-batches)::

    forward(s) of step t route with bias b_{t-1}       -> collect(stats) after each micro forward
    backward, optimizer step
    update(): b_t = QB(scores of step t, b_{t-1})      -> written into gate.e_score_correction_bias

so a step never routes with a bias computed from its own scores (causal routing), and the bias is
a pure function of the previous step's statistics. The statistics are what each forward returned
(``model(x, stats=ForwardStats())``, :mod:`k3.model.stats`): the balancer never sets anything on
the layers but their biases. ``sign`` is DeepSeek-V3's aux-loss-free update
``b + rate·sign(mean load − load)``; ``off`` keeps the bias and only reports load statistics.
The biases are persistent buffers of the model, so they travel with the model weights.

Histogram form (``bins``): instead of keeping the scores, each micro-batch adds its margins to a
per-expert histogram on the grid of :func:`qb_grid` (a function of the bias, so identical on every
rank), and the bias is read off the summed counts (``qb_bias_from_histogram``). With ``reduce`` (an
in-place SUM all-reduce) the step's counts, histograms and dropped-slot counts of every layer travel
in ONE int32 buffer, so all ranks install the same bias and report the same global load.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from k3.model.stats import ForwardStats
from k3.ops.routing import (load_stats, qb_bias_from_histogram, qb_margin_histogram, qb_margins,
                            quantile_balance_update, sign_update)

__all__ = ["RouterBalancer", "qb_grid"]


def qb_grid(bias: torch.Tensor) -> tuple[float, float]:
    """Histogram range of QB margins for router bias b: (−1 − 2·max|b|, 1 + 2·max|b|).

    Scores lie in (0, 1), the cut-off α in (min b, 1 + max b), so m = s − α lies inside it.
    """
    m = float(bias.detach().abs().max()) if bias.numel() else 0.0
    return -1.0 - 2.0 * m, 1.0 + 2.0 * m


class RouterBalancer:
    """Collects router statistics of one optimizer step and updates every MoE layer's bias."""

    def __init__(self, model: nn.Module | list[nn.Module], mode: str = "quantile", rate: float = 1e-3,
                 bins: int | None = None, reduce: Callable[[torch.Tensor], None] | None = None):
        """``model``: a model with ``moe_layers()`` (none: nothing to balance) or a list of MoE layers.
        ``bins``: histogram QB with that many bins (None: exact order statistic, one process only);
        ``reduce``: in-place SUM all-reduce of the per-step statistics (needs ``bins`` for QB)."""
        if reduce is not None and mode == "quantile" and not bins:
            raise ValueError("pooled Quantile Balancing needs histogram bins (qb_bins)")
        self.bins, self.reduce = bins, reduce
        if mode not in ("quantile", "sign", "off"):
            raise ValueError(f"balance mode must be 'quantile', 'sign' or 'off', got {mode!r}")
        self.mode, self.rate = mode, rate
        if isinstance(model, (list, tuple)):
            self.layers = list(model)
        else:
            self.layers = list(model.moe_layers()) if hasattr(model, "moe_layers") else []
        self._scores: list[list[torch.Tensor]] = [[] for _ in self.layers]
        self._counts: list[torch.Tensor | None] = [None for _ in self.layers]
        self._hists: list[torch.Tensor | None] = [None for _ in self.layers]
        self._dropped: list[int | None] = [None for _ in self.layers]

    def begin_step(self) -> None:
        self._scores = [[] for _ in self.layers]
        self._counts = [None for _ in self.layers]
        self._hists = [None for _ in self.layers]
        self._dropped = [None for _ in self.layers]

    def collect(self, stats: ForwardStats, keep: bool = True) -> None:
        """Take the router statistics of one micro-batch's forward (call once per micro-batch, with
        the ForwardStats that forward filled); ``keep`` False: the forward only kept this process in
        step with the others (padding), and adds zeros (every process still has every buffer of the
        step's one all-reduce)."""
        if not isinstance(stats, ForwardStats):
            raise TypeError(f"collect: stats must be the ForwardStats of a forward, got {type(stats).__name__}")
        for i, layer in enumerate(self.layers):
            r = stats.router.get(layer)
            if r is None:
                raise RuntimeError(f"router stats missing for MoE layer {i}: run the forward with "
                                   "stats=ForwardStats() (Trainer.forward does)")
            scores, counts, dropped = r.scores, r.counts, r.dropped
            if not keep:
                scores, counts, dropped = scores[:0], torch.zeros_like(counts), None
            if self.mode == "quantile" and self.bins:
                bias = layer.gate.e_score_correction_bias
                h = qb_margin_histogram(qb_margins(scores, bias, layer.top_k), self.bins, *qb_grid(bias))
                self._hists[i] = h if self._hists[i] is None else self._hists[i] + h
            elif self.mode == "quantile":
                self._scores[i].append(scores)
            if dropped is not None:
                self._dropped[i] = (self._dropped[i] or 0) + int(dropped)
            self._counts[i] = counts if self._counts[i] is None else self._counts[i] + counts

    def counts(self) -> list[torch.Tensor]:
        return [c for c in self._counts if c is not None]

    @torch.no_grad()
    def update(self) -> dict[str, list[float]]:
        """Install the next step's biases; return per-layer load CV and max/mean of this step."""
        stats = {"load_cv": [], "load_max_over_mean": []}
        if self.reduce is not None:
            self._all_reduce()
        if any(d is not None for d in self._dropped):
            stats["dropped_slots"] = sum(d or 0 for d in self._dropped)
        for i, layer in enumerate(self.layers):
            counts = self._counts[i]
            if counts is None:
                continue
            bias = layer.gate.e_score_correction_bias
            if self.mode == "quantile" and self.bins:
                bias.copy_(qb_bias_from_histogram(self._hists[i], *qb_grid(bias), layer.top_k))
            elif self.mode == "quantile":
                scores = torch.cat(self._scores[i]) if len(self._scores[i]) > 1 else self._scores[i][0]
                bias.copy_(quantile_balance_update(scores, bias, layer.top_k))
            elif self.mode == "sign":
                bias.copy_(sign_update(counts, bias, self.rate))
            s = load_stats(counts)
            stats["load_cv"].append(s["cv"])
            stats["load_max_over_mean"].append(s["max_over_mean"])
        self.begin_step()
        return stats

    def _all_reduce(self) -> None:
        """Sum counts [E], dropped slots [1] and histograms [E·bins] of every layer in one call."""
        parts = []
        for i, layer in enumerate(self.layers):
            if self._counts[i] is None:
                continue
            parts.append(self._counts[i].reshape(-1))
            parts.append(torch.tensor([self._dropped[i] or 0], device=self._counts[i].device))
            if self._hists[i] is not None:
                parts.append(self._hists[i].reshape(-1))
        if not parts:
            return
        buf = torch.cat([p.to(torch.int32) for p in parts])
        self.reduce(buf)
        off = 0
        for i, layer in enumerate(self.layers):
            if self._counts[i] is None:
                continue
            e = self._counts[i].numel()
            self._counts[i] = buf[off:off + e].long()
            had_drop = self._dropped[i] is not None
            self._dropped[i] = int(buf[off + e]) if had_drop or int(buf[off + e]) else None
            off += e + 1
            if self._hists[i] is not None:
                n = self._hists[i].numel()
                self._hists[i] = buf[off:off + n].long().view_as(self._hists[i])
                off += n
