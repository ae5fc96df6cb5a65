"""Statistics of evaluation scores (``k3 eval``): pass@k and bootstrap confidence intervals.

- ``pass_at_k(n, c, k)``: the probability that at least one of ``k`` samples drawn without
  replacement from ``n`` samples, ``c`` of them correct, is correct: ``1 - C(n-c, k) / C(n, k)``
  (the unbiased estimator of Chen et al. 2021, computed as a product so that large ``n`` stays
  exact in floating point).
- ``bootstrap_ci(groups, ...)``: a percentile interval of the mean score over *items* (tasks),
  resampling items with replacement (an item's samples stay together, so k samples of one task
  are not counted as k independent tasks); ``B`` resamples from a fixed seed, so one set of rows
  gives one interval.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

__all__ = ["pass_at_k", "bootstrap_ci", "mean_and_ci"]


def pass_at_k(n: int, c: int, k: int) -> float:
    if not (0 <= c <= n) or k < 1:
        raise ValueError(f"pass@k needs 0 <= c <= n and k >= 1, got n={n}, c={c}, k={k}")
    if k > n:
        raise ValueError(f"pass@{k} needs at least {k} samples per task, got {n}")
    if n - c < k:
        return 1.0
    miss = 1.0
    for i in range(n - c + 1, n + 1):  # C(n-c, k) / C(n, k) = prod_{i=n-c+1}^{n} (1 - k / i)
        miss *= 1.0 - k / i
    return 1.0 - miss


def bootstrap_ci(groups: Sequence[Sequence[float]], level: float = 0.95, resamples: int = 2000,
                 seed: int = 0) -> tuple[float, float]:
    """Percentile interval of the mean of per-item means, items resampled with replacement."""
    if not groups or any(len(g) == 0 for g in groups):
        raise ValueError("bootstrap_ci needs at least one item, each with at least one score")
    if not 0.0 < level < 1.0:
        raise ValueError(f"level must be in (0, 1), got {level}")
    item_means = np.array([float(np.mean(g)) for g in groups])
    if len(item_means) == 1:
        return float(item_means[0]), float(item_means[0])
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(item_means), size=(resamples, len(item_means)))
    means = item_means[idx].mean(axis=1)
    lo, hi = np.quantile(means, [(1 - level) / 2, 1 - (1 - level) / 2])
    return float(lo), float(hi)


def mean_and_ci(groups: Sequence[Sequence[float]], level: float = 0.95) -> dict:
    """``{"mean", "lo", "hi", "items", "samples"}`` of per-item scores (mean over items of their means)."""
    lo, hi = bootstrap_ci(groups, level)
    mean = float(np.mean([np.mean(g) for g in groups]))
    return {"mean": mean, "lo": lo, "hi": hi, "items": len(groups),
            "samples": int(sum(len(g) for g in groups))}
