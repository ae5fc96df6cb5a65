"""Router-bias balancing in the training loop (SPEC §3.6): Quantile Balancing or the sign update.

Timeline of one optimizer step t (with grad accumulation over micro-batches)::

    forward(s) of step t route with bias b_{t-1}       -> collect() after each micro forward
    backward, optimizer step
    update(): b_t = QB(scores of step t, b_{t-1})      -> written into gate.e_score_correction_bias

so a step never routes with a bias computed from its own scores (causal routing), and the bias is
a pure function of the previous step's statistics. ``sign`` is DeepSeek-V3's aux-loss-free update
``b + rate·sign(mean load − load)``; ``off`` keeps the bias and only reports load statistics.
The biases are persistent buffers of the model, so they travel with the model weights.
"""

from __future__ import annotations

import torch
from torch import nn

from k3.ops.routing import load_stats, quantile_balance_update, sign_update

__all__ = ["RouterBalancer"]


class RouterBalancer:
    """Collects router statistics of one optimizer step and updates every MoE layer's bias."""

    def __init__(self, model: nn.Module | list[nn.Module], mode: str = "quantile", rate: float = 1e-3):
        """``model``: a model with ``moe_layers()`` (none: nothing to balance) or a list of MoE layers."""
        if mode not in ("quantile", "sign", "off"):
            raise ValueError(f"balance mode must be 'quantile', 'sign' or 'off', got {mode!r}")
        self.mode, self.rate = mode, rate
        if isinstance(model, (list, tuple)):
            self.layers = list(model)
        else:
            self.layers = list(model.moe_layers()) if hasattr(model, "moe_layers") else []
        self._scores: list[list[torch.Tensor]] = [[] for _ in self.layers]
        self._counts: list[torch.Tensor | None] = [None for _ in self.layers]

    def recording(self, on: bool) -> None:
        """Turn the layers' stat recording on (training forwards) or off (eval, sampling)."""
        for layer in self.layers:
            layer.record_router_stats = on
            if not on:
                layer.last_scores = layer.last_counts = None

    def begin_step(self) -> None:
        self._scores = [[] for _ in self.layers]
        self._counts = [None for _ in self.layers]

    def collect(self) -> None:
        """Take the stats of the forward just run (call once after each micro-batch forward)."""
        for i, layer in enumerate(self.layers):
            if layer.last_scores is None or layer.last_counts is None:
                raise RuntimeError("router stats missing: call recording(True) before the forward")
            if self.mode == "quantile":
                self._scores[i].append(layer.last_scores)
            c = layer.last_counts
            self._counts[i] = c if self._counts[i] is None else self._counts[i] + c
            layer.last_scores = layer.last_counts = None

    def counts(self) -> list[torch.Tensor]:
        return [c for c in self._counts if c is not None]

    @torch.no_grad()
    def update(self) -> dict[str, list[float]]:
        """Install the next step's biases; return per-layer load CV and max/mean of this step."""
        stats = {"load_cv": [], "load_max_over_mean": []}
        for i, layer in enumerate(self.layers):
            counts = self._counts[i]
            if counts is None:
                continue
            bias = layer.gate.e_score_correction_bias
            if self.mode == "quantile":
                scores = torch.cat(self._scores[i]) if len(self._scores[i]) > 1 else self._scores[i][0]
                bias.copy_(quantile_balance_update(scores, bias, layer.top_k))
            elif self.mode == "sign":
                bias.copy_(sign_update(counts, bias, self.rate))
            s = load_stats(counts)
            stats["load_cv"].append(s["cv"])
            stats["load_max_over_mean"].append(s["max_over_mean"])
        self.begin_step()
        return stats
