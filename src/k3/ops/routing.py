"""MoE routing (SPEC §3.5 step 1) and the router-bias updates that balance expert load (§3.6).

Shapes: N tokens, E experts, k = experts per token, B histogram bins.

Routing::

    s      = act(logits)                  [N, E] fp32, act = sigmoid (K3) or softmax
    chosen = top-k of (s + b)             b = e_score_correction_bias, selection only
    p      = s[chosen] / (Σ s[chosen] + 1e-20) · scaling    (unbiased scores)

Quantile Balancing (K3): after a step, with that step's scores s and the bias b it routed with,

    α_t  = (k+1)-th largest of (s_t + b)          the token's cut-off
    m_tj = s_tj − α_t                             margin of expert j for token t (unbiased s)
    b̂_j  = −[(q+1)-th largest of m_{:,j}],  q = floor(N·k / E)
    b    ← b̂ − mean(b̂)

With b̂, token t picks j roughly iff s_tj + b̂_j > α_t, i.e. iff m_tj is among expert j's q largest
margins, so every expert receives about q = N·k/E tokens. b̂ replaces b (it is not an increment).
The bias is a pure function of one step's statistics; the caller writes it into the router after
the step, so a step never routes with a bias computed from itself.

The distributed form replaces the exact order statistic by a histogram of margins on a fixed grid
(identical on all ranks) that can be summed with one all-reduce; the quantile is read off the
pooled counts with linear interpolation inside a bin. Because the read-out only sees the summed
counts, summing per-rank histograms and reading equals reading the pooled histogram.
"""

from __future__ import annotations

import torch

__all__ = [
    "route_topk",
    "qb_margins",
    "qb_target_count",
    "quantile_balance_update",
    "qb_margin_histogram",
    "qb_bias_from_histogram",
    "sign_update",
    "load_stats",
]


def _router_scores(logits: torch.Tensor, activation: str) -> torch.Tensor:
    if activation == "sigmoid":
        return torch.sigmoid(logits.float())
    if activation == "softmax":
        return torch.softmax(logits.float(), dim=-1)
    raise ValueError(f"activation must be 'sigmoid' or 'softmax', got {activation!r}")


def _group_mask(sel: torch.Tensor, num_groups: int, topk_group: int) -> torch.Tensor:
    """DeepSeek-V3 group-limited routing: keep the experts of the topk_group best groups.

    sel [N, E] (biased scores) -> sel with experts of dropped groups set to -inf. A group's score
    is the sum of its two best biased scores (its best one when a group holds a single expert).
    """
    n, e = sel.shape
    grouped = sel.view(n, num_groups, e // num_groups)
    group_score = grouped.topk(min(2, e // num_groups), dim=-1).values.sum(-1)  # [N, G]
    keep = group_score.topk(topk_group, dim=-1).indices
    mask = torch.zeros(n, num_groups, dtype=torch.bool, device=sel.device).scatter_(1, keep, True)
    return grouped.masked_fill(~mask.unsqueeze(-1), float("-inf")).view(n, e)


def route_topk(
    logits: torch.Tensor,
    bias: torch.Tensor | None,
    top_k: int,
    activation: str = "sigmoid",
    renormalize: bool = True,
    scaling: float = 1.0,
    num_groups: int = 1,
    topk_group: int = 1,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Top-k routing with a selection-only bias.

    logits [N, E] (any dtype), bias [E] or None ->
    (weights [N, k] fp32, indices [N, k] int64, scores [N, E] fp32).
    Differentiable w.r.t. logits through the weights; the bias never receives a gradient.
    """
    if logits.dim() != 2:
        raise ValueError(f"logits must be [N, E], got shape {tuple(logits.shape)}")
    n_exp = logits.shape[-1]
    if not 0 < top_k <= n_exp:
        raise ValueError(f"top_k must be in [1, {n_exp}], got {top_k}")
    if num_groups < 1 or n_exp % num_groups:
        raise ValueError(f"num_groups ({num_groups}) must divide the number of experts ({n_exp})")
    if num_groups > 1 and not 0 < topk_group <= num_groups:
        raise ValueError(f"topk_group must be in [1, {num_groups}], got {topk_group}")
    scores = _router_scores(logits, activation)
    sel = scores.detach()
    if bias is not None:
        if bias.shape != (n_exp,):
            raise ValueError(f"bias must have shape [{n_exp}], got {tuple(bias.shape)}")
        sel = sel + bias.detach().float()
    if num_groups > 1:
        sel = _group_mask(sel, num_groups, topk_group)
    indices = sel.topk(top_k, dim=-1).indices
    weights = scores.gather(1, indices)
    if renormalize:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    if scaling != 1.0:
        weights = weights * scaling
    return weights, indices, scores


# --------------------------------------------------------------------------- Quantile Balancing
def qb_target_count(num_tokens: int, num_experts: int, top_k: int) -> int:
    """q = floor(N·k / E), the per-expert token count QB aims for, clamped to [0, N−1].

    The floor keeps Σ_j q ≤ N·k (no expert is asked for more slots than exist); the clamp only
    matters for k ≥ E, where every expert would take every token and the order statistic used is
    the smallest margin.
    """
    return max(0, min(num_tokens * top_k // num_experts, num_tokens - 1))


def qb_margins(scores: torch.Tensor, bias: torch.Tensor, top_k: int) -> torch.Tensor:
    """m_tj = s_tj − α_t with α_t the (k+1)-th largest of s_t + b. scores [N, E] -> [N, E] fp32."""
    n_exp = scores.shape[-1]
    if not 0 < top_k < n_exp:
        raise ValueError(f"quantile balancing needs 0 < top_k < num_experts ({n_exp}), got {top_k}")
    s = scores.detach().float()
    alpha = (s + bias.detach().float()).topk(top_k + 1, dim=-1).values[:, top_k:]  # [N, 1]
    return s - alpha


def quantile_balance_update(scores: torch.Tensor, bias: torch.Tensor, top_k: int) -> torch.Tensor:
    """Exact Quantile Balancing (SPEC §3.6). scores [N, E], bias [E] -> new bias [E] fp32.

    Pure: the inputs are not modified; the caller installs the result for the next step.
    """
    if scores.dim() != 2 or bias.shape != scores.shape[-1:]:
        raise ValueError(f"scores must be [N, E] and bias [E], got {tuple(scores.shape)} and "
                         f"{tuple(bias.shape)}")
    m = qb_margins(scores, bias, top_k)
    n, e = m.shape
    q = qb_target_count(n, e, top_k)
    cut = m.topk(q + 1, dim=0).values[q]  # (q+1)-th largest margin per expert, [E]
    b_hat = -cut
    return b_hat - b_hat.mean()


def qb_margin_histogram(margins: torch.Tensor, bins: int, lo: float, hi: float) -> torch.Tensor:
    """Per-expert histogram of margins on a fixed grid. margins [N, E] -> counts [E, bins] int64.

    Bins split [lo, hi] evenly; values outside are counted in the edge bins. Every rank must use
    the same (bins, lo, hi); the counts are then summed with one all-reduce. Sigmoid margins lie
    in (−1 − 2·max|b|, 1 + 2·max|b|), a safe range.
    """
    if bins < 1 or not hi > lo:
        raise ValueError(f"need bins >= 1 and hi > lo, got bins={bins}, lo={lo}, hi={hi}")
    n, e = margins.shape
    width = (hi - lo) / bins
    b = ((margins.detach().double() - lo) / width).floor().clamp_(0, bins - 1).long()
    flat = b + torch.arange(e, device=margins.device) * bins
    return torch.bincount(flat.reshape(-1), minlength=e * bins).view(e, bins)


def qb_bias_from_histogram(hist: torch.Tensor, lo: float, hi: float, top_k: int) -> torch.Tensor:
    """Quantile Balancing from (pooled) margin histograms. hist [E, bins] -> new bias [E] fp32.

    N is read from the counts (each token contributes one margin per expert). The (q+1)-th largest
    margin is the point where the interpolated tail count T(v) = #{m > v} equals q + ½: treating
    the c samples of a bin as spread evenly, the i-th largest sits where T = i − ½.
    """
    e, bins = hist.shape
    h = hist.double()
    n = int(round(h[0].sum().item()))
    target = qb_target_count(n, e, top_k) + 0.5
    tail_lo = h.flip(-1).cumsum(-1).flip(-1)         # [E, bins] count at or above each lower edge
    b = ((tail_lo > target).sum(-1) - 1).clamp(0, bins - 1)  # last bin whose lower edge is above it
    tail_up = tail_lo.gather(1, b[:, None]).squeeze(1) - h.gather(1, b[:, None]).squeeze(1)
    cnt = h.gather(1, b[:, None]).squeeze(1).clamp_min(1e-12)
    frac = ((target - tail_up) / cnt).clamp(0, 1)
    width = (hi - lo) / bins
    cut = lo + (b.double() + 1 - frac) * width
    b_hat = -cut
    return (b_hat - b_hat.mean()).float()


# --------------------------------------------------------------------------- other balancers
def sign_update(counts: torch.Tensor, bias: torch.Tensor, rate: float = 1e-3) -> torch.Tensor:
    """DeepSeek-V3 aux-loss-free update: b + rate·sign(mean load − load). counts, bias [E] -> [E]."""
    load = counts.detach().double()
    return (bias.detach().double() + rate * torch.sign(load.mean() - load)).to(bias.dtype)


def load_stats(counts: torch.Tensor) -> dict[str, float]:
    """Load-balance summary of per-expert token counts [E]: coefficient of variation, max/mean."""
    c = counts.detach().double()
    mean = c.mean()
    if mean <= 0:
        return {"cv": 0.0, "max_over_mean": 0.0}
    return {"cv": (c.std(unbiased=False) / mean).item(), "max_over_mean": (c.max() / mean).item()}
