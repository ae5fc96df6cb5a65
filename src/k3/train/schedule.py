"""Learning-rate and context-length schedules, both plain data (``to_dict`` / ``from_dict``).

WSD (warmup–stable–decay), as a multiplier f(step) of the peak lr, for optimizer step s = 0, 1, …:

    warmup   s < W:              f = (s + 1) / W
    stable   W ≤ s < N − D:      f = 1
    decay    N − D ≤ s < N:      p = (s − (N − D) + 1) / D ∈ (0, 1]
                                  linear: f = 1 − p·(1 − r);  cosine: f = r + (1 − r)·(1 + cos πp)/2
    after    s ≥ N:              f = r

with N = total_steps, W = warmup_steps, D = decay_steps, r = min_lr_ratio (the floor). The first
step already trains (f(0) = 1/W) and the last step (s = N − 1) runs exactly at the floor.
``schedule`` itself is the LambdaLR lambda: ``LambdaLR(opt, schedule)``.

Context-length curriculum: stages ``[(start_step, seq_len), ...]`` sorted by start, the first at
step 0; ``seq_len_at(step)`` is the seq_len of the last stage started at or before ``step``.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import asdict, dataclass
from typing import Any, Sequence

__all__ = ["WSDSchedule", "ContextCurriculum"]


@dataclass
class WSDSchedule:
    total_steps: int
    warmup_steps: int = 0
    decay_steps: int = 0
    min_lr_ratio: float = 0.1
    decay: str = "linear"  # or "cosine"
    peak_lr: float = 1.0

    def __post_init__(self) -> None:
        if self.total_steps <= 0:
            raise ValueError(f"total_steps must be > 0, got {self.total_steps}")
        if self.warmup_steps < 0 or self.decay_steps < 0:
            raise ValueError("warmup_steps and decay_steps must be >= 0")
        if self.warmup_steps + self.decay_steps > self.total_steps:
            raise ValueError(f"warmup_steps + decay_steps ({self.warmup_steps} + "
                             f"{self.decay_steps}) exceed total_steps ({self.total_steps})")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if self.decay not in ("linear", "cosine"):
            raise ValueError(f"decay must be 'linear' or 'cosine', got {self.decay!r}")

    @classmethod
    def from_fractions(cls, total_steps: int, warmup: float = 0.01, decay: float = 0.2,
                       **kw: Any) -> "WSDSchedule":
        """Warmup and decay given as fractions of ``total_steps`` (rounded)."""
        return cls(total_steps, round(warmup * total_steps), round(decay * total_steps), **kw)

    def factor(self, step: int) -> float:
        W, D, N, r = self.warmup_steps, self.decay_steps, self.total_steps, self.min_lr_ratio
        if step < W:
            return (step + 1) / W
        if step >= N:
            return r
        if step < N - D:
            return 1.0
        p = (step - (N - D) + 1) / D
        if self.decay == "linear":
            return 1.0 - p * (1.0 - r)
        return r + (1.0 - r) * 0.5 * (1.0 + math.cos(math.pi * p))

    __call__ = factor

    def lr_at(self, step: int) -> float:
        return self.peak_lr * self.factor(step)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "WSDSchedule":
        return cls(**d)


@dataclass
class ContextCurriculum:
    stages: list[tuple[int, int]]

    def __post_init__(self) -> None:
        self.stages = [(int(s), int(t)) for s, t in self.stages]
        if not self.stages:
            raise ValueError("a curriculum needs at least one stage")
        if self.stages[0][0] != 0:
            raise ValueError(f"the first stage must start at step 0, got {self.stages[0][0]}")
        starts = [s for s, _ in self.stages]
        if any(b <= a for a, b in zip(starts, starts[1:])):
            raise ValueError(f"stage start steps must increase strictly, got {starts}")
        if any(t <= 0 for _, t in self.stages):
            raise ValueError("every stage's seq_len must be > 0")
        self._starts = starts

    @classmethod
    def constant(cls, seq_len: int) -> "ContextCurriculum":
        return cls([(0, seq_len)])

    @classmethod
    def parse(cls, text: str) -> "ContextCurriculum":
        """``"0:256,2000:512,4000:1024"`` → stages (the CLI form)."""
        try:
            stages = [tuple(int(x) for x in item.split(":")) for item in text.split(",") if item]
        except ValueError:
            raise ValueError(f"curriculum must look like '0:256,1000:512', got {text!r}") from None
        if any(len(s) != 2 for s in stages):
            raise ValueError(f"curriculum must look like '0:256,1000:512', got {text!r}")
        return cls(stages)

    def seq_len_at(self, step: int) -> int:
        return self.stages[max(bisect.bisect_right(self._starts, step) - 1, 0)][1]

    @property
    def max_seq_len(self) -> int:
        return max(t for _, t in self.stages)

    def to_list(self) -> list[list[int]]:
        return [[s, t] for s, t in self.stages]

    @classmethod
    def from_list(cls, stages: Sequence[Sequence[int]]) -> "ContextCurriculum":
        return cls([tuple(s) for s in stages])
