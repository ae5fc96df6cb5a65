"""Policy-gradient losses of RL from verifier rewards (SPEC §10): pure tensor functions.

Group-relative advantages (GRPO): the G rollouts of one task form a group with rewards r_1..r_G::

    A_i = r_i − mean(r)            (÷ (std(r) + eps) with ``scale_std``; std over the group, unbiased=False)

A group whose rewards are all equal has A = 0 exactly and teaches nothing (``degenerate`` counts
those groups).

Token-level clipped surrogate (PPO / GRPO / DAPO-style), over the tokens the policy sampled
(``mask`` 1; never prompt, tool-result or forced tokens), each token weighing the same::

    ratio_t = exp(logp_t − old_t)                               old: the sampler's recorded logprob
    s_t     = min(ratio_t · A_t, clip(ratio_t, 1 − eps_low, 1 + eps_high) · A_t)
    kl_t    = exp(ref_t − logp_t) − (ref_t − logp_t) − 1         Schulman's k3 estimator of KL(π ‖ π_ref)
    loss    = Σ_t mask_t (−s_t + beta · kl_t) / Σ_t mask_t

``A_t`` is the advantage of the rollout token t belongs to. k3 is unbiased for the KL, never
negative, and its gradient is that of the KL at the sampled tokens (the estimator DeepSeek-R1's
GRPO uses). Returns the loss and statistics (mean ratio, the fraction of tokens where the clipped
branch is the one taken, the mean k3 KL).
"""

from __future__ import annotations

import torch

__all__ = ["group_advantages", "clipped_policy_loss"]


def group_advantages(rewards: torch.Tensor, groups: torch.Tensor, scale_std: bool = False,
                     eps: float = 1e-6) -> tuple[torch.Tensor, int]:
    """rewards [N] float, groups [N] int (the group of each rollout) -> (advantages [N] fp32,
    the number of groups whose rewards are all equal)."""
    if rewards.dim() != 1 or groups.shape != rewards.shape:
        raise ValueError(f"rewards and groups must be [N] of one shape, got {tuple(rewards.shape)} "
                         f"and {tuple(groups.shape)}")
    r = rewards.float()
    adv = torch.zeros_like(r)
    degenerate = 0
    for g in torch.unique(groups).tolist():
        sel = groups == g
        if int(sel.sum()) < 2:
            raise ValueError(f"group {g} has {int(sel.sum())} rollout; a group needs at least 2")
        rg = r[sel]
        a = rg - rg.mean()
        if bool((rg == rg[0]).all()):
            degenerate += 1
            a = torch.zeros_like(rg)
        elif scale_std:
            a = a / (rg.std(unbiased=False) + eps)
        adv[sel] = a
    return adv, degenerate


def clipped_policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
                        mask: torch.Tensor, eps_low: float = 0.2, eps_high: float = 0.2,
                        beta: float = 0.0, ref_logp: torch.Tensor | None = None
                        ) -> tuple[torch.Tensor, dict[str, float]]:
    """logp [*] (differentiable), old_logp, advantages, mask (0/1), ref_logp: same shape [*] ->
    (loss [], stats). ``beta`` > 0 needs ``ref_logp``."""
    shape = logp.shape
    for name, t in (("old_logp", old_logp), ("advantages", advantages), ("mask", mask)):
        if t.shape != shape:
            raise ValueError(f"{name} shape {tuple(t.shape)} != logp shape {tuple(shape)}")
    if beta > 0 and (ref_logp is None or ref_logp.shape != shape):
        raise ValueError("beta > 0 needs ref_logp of the logp shape")
    if eps_low < 0 or eps_high < 0:
        raise ValueError(f"eps_low and eps_high must be >= 0, got {eps_low}, {eps_high}")
    m = mask.float()
    n = m.sum().clamp_min(1.0)
    lp, adv = logp.float(), advantages.float()
    ratio = torch.exp(lp - old_logp.float())
    unclipped = ratio * adv
    clipped = ratio.clamp(1.0 - eps_low, 1.0 + eps_high) * adv
    surrogate = torch.minimum(unclipped, clipped)
    loss_t = -surrogate
    kl = torch.zeros_like(lp)
    if ref_logp is not None:
        d = ref_logp.float() - lp
        kl = torch.exp(d) - d - 1.0
        if beta > 0:
            loss_t = loss_t + beta * kl
    loss = (loss_t * m).sum() / n
    with torch.no_grad():
        took_clip = (clipped < unclipped).float()
        stats = {"ratio": float((ratio * m).sum() / n), "clip_fraction": float((took_clip * m).sum() / n),
                 "kl": float((kl * m).sum() / n), "tokens": float(m.sum())}
    return loss, stats
