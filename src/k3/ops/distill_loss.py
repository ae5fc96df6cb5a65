"""On-policy distillation losses (SPEC §10): the student samples, a teacher scores every token the
student wrote, and the per-token reverse KL KL(π_s ‖ π_t) is what the student minimises. Pure
tensor functions.

At a position t whose next token x_t the student sampled (``mask`` 1: never prompt, tool-result or
forced tokens), with student logprobs s(·) and teacher logprobs q(·) over the vocabulary::

    exact KL      KL_t = Σ_v exp(s(v)) · (s(v) − q(v))                    (needs the teacher's whole row)
    sampled       k_t  = s(x_t) − q(x_t)                                   (needs only q(x_t): a remote teacher)

E_{x_t ~ π_s}[k_t] = KL_t, so the sampled form is an unbiased estimate of the exact one. They are
trained two ways:

- ``reverse_kl_exact``: the loss is Σ_t mask_t · KL_t, differentiated through the student's whole
  row (no sampling noise in the gradient). With ``top_k`` only the student's k most likely tokens
  keep their own entries and the rest of each distribution is one bucket (its mass 1 − Σ top-k);
  that is the KL of the two coarsened distributions, never more than the exact KL, and equal to it
  when the tail buckets agree.
- ``reverse_kl_sampled``: the score-function (REINFORCE) form with k_t as a per-token cost, as a
  policy gradient with a discount of 0 (the cost of a token does not flow to the tokens before it):
  loss_t = sg(k_t) · ρ_t with ρ_t = exp(s(x_t) − old_t) the importance ratio against the sampler's
  recorded logprob (1 when sampler and learner hold the same weights, as in ``k3 distill``), so
  ∇loss_t = k_t · ∇s(x_t), whose expectation over x_t ~ π_s is ∇KL_t. Its reported value is k_t
  (the estimate of the KL), not the surrogate.

The forward direction, ``forward_kl_exact``: KL(π_t ‖ π_s)_t = Σ_v exp(q(v)) · (q(v) − s(v)) on the
same positions (the student's own samples; TRL's GKD at β = 0 on-policy), with the same ``top_k``
buckets. Its gradient in the student's logits is π_s − π_t, which stays large where the student is
confidently wrong; the reverse KL's, π_s · (s − q − KL_t), vanishes there as π_s of the teacher's
token goes to 0 (mode-seeking). ``k3 distill --forward-weight w`` trains ``mixed_kl_exact``,
(1 − w) · reverse + w · forward on one coarsening of the rows; the reported KL is always the
reverse one.

All are 0 with zero gradient when the student equals the teacher. Each returns the sum over masked
tokens (the caller divides by the step's trained tokens, as the Trainer does for every objective)
and statistics (the KL estimate summed over the tokens, the token count).
"""

from __future__ import annotations

import torch

__all__ = ["forward_kl_exact", "mixed_kl_exact", "reverse_kl_exact", "reverse_kl_sampled"]


def _up(t: torch.Tensor) -> torch.Tensor:
    """At least fp32 (bf16 logits are computed on in fp32; fp64 stays fp64)."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def _check(name: str, t: torch.Tensor, shape) -> None:
    if t.shape != shape:
        raise ValueError(f"{name} shape {tuple(t.shape)} != {tuple(shape)}")


def reverse_kl_exact(student_logits: torch.Tensor, teacher_logprobs: torch.Tensor, mask: torch.Tensor,
                     top_k: int | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """student_logits [*, V] (differentiable), teacher_logprobs [*, V] (log-softmax of the
    teacher), mask [*] 0/1 -> (Σ_t mask_t · KL_t, stats). ``top_k``: the student's k most likely
    tokens and one tail bucket (module doc)."""
    return mixed_kl_exact(student_logits, teacher_logprobs, mask, top_k, 0.0)


def forward_kl_exact(student_logits: torch.Tensor, teacher_logprobs: torch.Tensor, mask: torch.Tensor,
                     top_k: int | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """As ``reverse_kl_exact`` for KL(π_t ‖ π_s): Σ_t mask_t · Σ_v exp(q(v)) · (q(v) − s(v)) (module
    doc); ``top_k`` coarsens both rows into the student's k likeliest tokens and one tail bucket."""
    s, q = _rows(student_logits, teacher_logprobs, mask, top_k)
    loss = _masked_kl(q, s, mask)
    return loss, {"kl": float(loss.detach()), "tokens": float(mask.sum())}


def mixed_kl_exact(student_logits: torch.Tensor, teacher_logprobs: torch.Tensor, mask: torch.Tensor,
                   top_k: int | None = None, forward_weight: float = 0.0) -> tuple[torch.Tensor, dict[str, float]]:
    """(1 − w) · ``reverse_kl_exact`` + w · ``forward_kl_exact`` on one coarsening of the rows
    (``w`` = ``forward_weight``; 0 computes the reverse KL alone); the stats are the reverse KL's."""
    s, q = _rows(student_logits, teacher_logprobs, mask, top_k)
    reverse = _masked_kl(s, q, mask)
    stats = {"kl": float(reverse.detach()), "tokens": float(mask.sum())}
    if not forward_weight:
        return reverse, stats
    return (1 - forward_weight) * reverse + forward_weight * _masked_kl(q, s, mask), stats


def _masked_kl(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Σ_t mask_t · Σ_v exp(a(v)) · (a(v) − b(v)): KL(exp a ‖ exp b) summed over the masked rows."""
    kl_t = (a.exp() * (a - b)).sum(-1)
    return (kl_t * mask.to(kl_t.dtype)).sum()


def _rows(student_logits, teacher_logprobs, mask, top_k):
    """The student's and the teacher's log-probability rows, checked, at least fp32; with
    ``top_k``: the student's k likeliest tokens of both and one tail bucket each (log(1 − Σ top-k),
    a log-sum-exp of the tail for precision)."""
    _check("teacher_logprobs", teacher_logprobs, student_logits.shape)
    _check("mask", mask, student_logits.shape[:-1])
    s = torch.log_softmax(_up(student_logits), -1)
    q = _up(teacher_logprobs)
    if top_k is None:
        return s, q
    V = s.shape[-1]
    if not 1 <= top_k < V:
        raise ValueError(f"top_k must be in 1..{V - 1} (the vocabulary has {V} tokens), got {top_k}")
    idx = s.detach().topk(top_k, -1).indices
    keep = torch.zeros_like(s, dtype=torch.bool).scatter_(-1, idx, True)
    tail_s = torch.logsumexp(s.masked_fill(keep, float("-inf")), -1, keepdim=True)
    tail_q = torch.logsumexp(q.masked_fill(keep, float("-inf")), -1, keepdim=True)
    return torch.cat([s.gather(-1, idx), tail_s], -1), torch.cat([q.gather(-1, idx), tail_q], -1)


def reverse_kl_sampled(logp: torch.Tensor, old_logp: torch.Tensor, teacher_logp: torch.Tensor,
                       mask: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
    """logp [*] the student's logprob of each sampled token (differentiable), old_logp [*] the
    sampler's recorded one, teacher_logp [*] the teacher's, mask [*] 0/1 -> (Σ_t mask_t ·
    sg(k_t) · ρ_t, stats with ``kl`` = Σ_t mask_t · k_t)."""
    for name, t in (("old_logp", old_logp), ("teacher_logp", teacher_logp), ("mask", mask)):
        _check(name, t, logp.shape)
    lp = _up(logp)
    m = mask.to(lp.dtype)
    k = (lp - _up(teacher_logp)).detach()
    ratio = torch.exp(lp - _up(old_logp))
    loss = (k * ratio * m).sum()
    return loss, {"kl": float((k * m).sum()), "tokens": float(m.sum())}
