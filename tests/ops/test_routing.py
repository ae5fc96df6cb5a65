"""Routing (top-k with selection-only bias) and the router-bias balancers, against naive references."""

import math

import pytest
import torch

from k3.ops.routing import (
    load_stats,
    qb_bias_from_histogram,
    qb_margin_histogram,
    qb_margins,
    qb_target_count,
    quantile_balance_update,
    route_topk,
    sign_update,
)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny matmuls: one thread avoids oversubscription stalls on a shared 2-core machine."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def route_naive(logits, bias, k, activation, renormalize, scaling, groups, topk_group):
    """One token at a time, in float64."""
    ws, ids = [], []
    n, e = logits.shape
    for t in range(n):
        lt = logits[t].double()
        s = torch.sigmoid(lt) if activation == "sigmoid" else torch.softmax(lt, -1)
        sd = s.detach()
        sel = [float(sd[j]) + (float(bias[j]) if bias is not None else 0.0) for j in range(e)]
        allowed = set(range(e))
        if groups > 1:
            gsz = e // groups
            gs = [sum(sorted(sel[g * gsz:(g + 1) * gsz], reverse=True)[:2]) for g in range(groups)]
            keep = sorted(range(groups), key=lambda g: -gs[g])[:topk_group]
            allowed = {j for j in range(e) if j // gsz in keep}
        chosen = sorted(allowed, key=lambda j: -sel[j])[:k]
        w = torch.stack([s[j] for j in chosen])
        if renormalize:
            w = w / (w.sum() + 1e-20)
        ws.append(w * scaling)
        ids.append(chosen)
    return torch.stack(ws), torch.tensor(ids)


@pytest.mark.parametrize("activation,renormalize,scaling,groups,topk_group,k", [
    ("sigmoid", True, 1.0, 1, 1, 2),
    ("sigmoid", True, 2.5, 1, 1, 3),
    ("softmax", False, 1.0, 1, 1, 2),
    ("softmax", True, 1.0, 4, 2, 3),
    ("sigmoid", True, 1.0, 4, 2, 4),
    ("sigmoid", False, 1.0, 8, 3, 3),  # groups of two experts
])
def test_route_topk_matches_per_token_reference(activation, renormalize, scaling, groups, topk_group, k):
    torch.manual_seed(0)
    logits = torch.randn(24, 16, requires_grad=True)
    bias = torch.randn(16) * 0.2
    w, i, s = route_topk(logits, bias, k, activation, renormalize, scaling, groups, topk_group)
    w_ref, i_ref = route_naive(logits, bias, k, activation, renormalize, scaling, groups, topk_group)
    assert w.dtype == torch.float32 and s.dtype == torch.float32 and i.dtype == torch.int64
    assert torch.equal(i, i_ref)  # both ordered by biased score, best first
    torch.testing.assert_close(w, w_ref.float())
    gw = torch.randn_like(w)
    (g,) = torch.autograd.grad(w, logits, gw)
    (g_ref,) = torch.autograd.grad(w_ref.float(), logits, gw)
    torch.testing.assert_close(g, g_ref)


def test_large_bias_changes_selection_but_weights_are_unbiased_scores():
    torch.manual_seed(1)
    logits = torch.randn(50, 8)
    bias = torch.zeros(8)
    bias[3] = 100.0
    w, i, s = route_topk(logits, bias, 2)
    assert (i == 3).any(-1).all()
    sel = s.gather(1, i)
    torch.testing.assert_close(w, sel / sel.sum(-1, keepdim=True))
    torch.testing.assert_close(s, torch.sigmoid(logits))


def test_bias_gets_no_gradient_and_logits_do():
    logits = torch.randn(10, 8, requires_grad=True)
    bias = (torch.randn(8) * 0.1).requires_grad_()
    w, _, _ = route_topk(logits, bias, 2, renormalize=False)
    w.sum().backward()
    assert bias.grad is None
    assert logits.grad is not None and logits.grad.abs().sum() > 0


def test_route_topk_rejects_bad_arguments():
    x = torch.randn(4, 8)
    with pytest.raises(ValueError, match="top_k"):
        route_topk(x, None, 9)
    with pytest.raises(ValueError, match="num_groups"):
        route_topk(x, None, 2, num_groups=3)
    with pytest.raises(ValueError, match="bias"):
        route_topk(x, torch.zeros(7), 2)
    with pytest.raises(ValueError, match="activation"):
        route_topk(x, None, 2, activation="relu")


# ------------------------------------------------------------------------ Quantile Balancing
def qb_naive(scores, bias, k):
    s = scores.double()
    n, e = s.shape
    alpha = torch.tensor([sorted((s[t] + bias.double()).tolist(), reverse=True)[k] for t in range(n)])
    m = s - alpha[:, None]
    q = min(n * k // e, n - 1)
    b_hat = torch.tensor([-sorted(m[:, j].tolist(), reverse=True)[q] for j in range(e)])
    return (b_hat - b_hat.mean()).float()


def test_quantile_balance_update_matches_naive_and_is_pure():
    torch.manual_seed(2)
    scores = torch.sigmoid(torch.randn(200, 12) + torch.linspace(-1, 1, 12))
    bias = torch.randn(12) * 0.1
    s0, b0 = scores.clone(), bias.clone()
    new = quantile_balance_update(scores, bias, 3)
    torch.testing.assert_close(new, qb_naive(scores, bias, 3), rtol=0, atol=1e-6)
    assert torch.equal(scores, s0) and torch.equal(bias, b0)  # inputs untouched
    assert torch.equal(quantile_balance_update(scores, bias, 3), new)  # deterministic
    assert abs(new.mean().item()) < 1e-6


def test_qb_target_count_rounds_down_and_clamps():
    assert qb_target_count(4096, 16, 2) == 512
    assert qb_target_count(10, 3, 1) == 3  # 10/3 floored
    assert qb_target_count(5, 4, 4) == 4  # q = N would need a (N+1)-th value: clamped to N-1
    assert qb_target_count(1, 8, 1) == 0


def test_repeated_updates_on_fixed_scores_converge_to_balance():
    torch.manual_seed(3)
    n, e, k = 2048, 16, 2
    scores = torch.sigmoid(torch.randn(n, e) + torch.linspace(-3, 3, e))
    logits = torch.logit(scores)
    bias = torch.zeros(e)
    cvs = []
    for _ in range(8):
        bias = quantile_balance_update(scores, bias, k)
        _, idx, _ = route_topk(logits, bias, k)
        cvs.append(load_stats(torch.bincount(idx.flatten(), minlength=e))["cv"])
    assert all(b <= a + 1e-3 for a, b in zip(cvs, cvs[1:])), cvs
    assert cvs[-1] < 0.04, cvs


@pytest.mark.parametrize("use_histogram", [False, True])
def test_quantile_balancing_fixes_a_skewed_router_within_10_steps(use_histogram):
    """Each step routes fresh tokens with the current bias, then computes the next bias."""
    gen = torch.Generator().manual_seed(4)
    n, e, k = 4096, 16, 2
    offsets = torch.linspace(-3, 3, e)
    bias = torch.zeros(e)
    cvs = []
    for _ in range(11):
        logits = torch.randn(n, e, generator=gen) + offsets
        bias_copy = bias.clone()
        _, idx, scores = route_topk(logits, bias, k)
        cvs.append(load_stats(torch.bincount(idx.flatten(), minlength=e))["cv"])
        if use_histogram:
            r = 1 + 2 * bias.abs().max().item()
            hist = qb_margin_histogram(qb_margins(scores, bias, k), 256, -r, r)
            new_bias = qb_bias_from_histogram(hist, -r, r, k)
        else:
            new_bias = quantile_balance_update(scores, bias, k)
        assert torch.equal(bias, bias_copy)  # the bias this step routed with is left as it was
        bias = new_bias
    assert cvs[0] > 1.0
    assert cvs[10] <= 0.1, cvs


def test_histogram_form_approximates_exact_and_pools_across_ranks():
    torch.manual_seed(5)
    n, e, k = 4000, 16, 2
    scores = torch.sigmoid(torch.randn(n, e) * 1.5 + torch.linspace(-2, 2, e))
    bias = torch.randn(e) * 0.2
    exact = quantile_balance_update(scores, bias, k)
    r = 1 + 2 * bias.abs().max().item()
    bins = 512
    m = qb_margins(scores, bias, k)
    pooled = qb_margin_histogram(m, bins, -r, r)
    assert pooled.shape == (e, bins) and int(pooled.sum()) == n * e
    approx = qb_bias_from_histogram(pooled, -r, r, k)
    assert (approx - exact).abs().max() < 2 * r / bins  # within one bin width
    # four "ranks" with their own tokens: summed histograms give the pooled answer exactly
    per_rank = sum(qb_margin_histogram(chunk, bins, -r, r) for chunk in m.chunk(4))
    assert torch.equal(per_rank, pooled)
    torch.testing.assert_close(qb_bias_from_histogram(per_rank, -r, r, k), approx)


def test_histogram_interpolation_inside_a_bin():
    # one expert, 4 margins all in bin [0, 1) of a 2-bin grid on [-1, 1]; q = floor(4·1/2) = 2
    hist = torch.tensor([[0, 4], [4, 0]])
    b = qb_bias_from_histogram(hist, -1.0, 1.0, 1)
    # expert 0: tail count 2.5 of 4 spread over [0,1) -> cut at 1 - 2.5/4 = 0.375
    # expert 1: same inside [-1, 0) -> cut at -0.625; b_hat = (-0.375, 0.625), centred
    torch.testing.assert_close(b, torch.tensor([-0.5, 0.5]))


def test_margin_histogram_clamps_out_of_range_values_to_edge_bins():
    m = torch.tensor([[-5.0], [0.1], [7.0]])
    assert qb_margin_histogram(m, 4, -1.0, 1.0).tolist() == [[1, 0, 1, 1]]


def test_quantile_balance_rejects_bad_shapes_and_k():
    with pytest.raises(ValueError):
        quantile_balance_update(torch.rand(10, 4), torch.zeros(3), 1)
    with pytest.raises(ValueError, match="top_k"):
        quantile_balance_update(torch.rand(10, 4), torch.zeros(4), 4)


# ------------------------------------------------------------------------ other balancers
def test_sign_update_moves_bias_towards_underloaded_experts():
    counts = torch.tensor([10, 30, 20, 20])
    bias = torch.zeros(4)
    new = sign_update(counts, bias, rate=0.01)
    torch.testing.assert_close(new, torch.tensor([0.01, -0.01, 0.0, 0.0]))
    assert torch.equal(bias, torch.zeros(4))


def test_load_stats_values():
    st = load_stats(torch.tensor([1, 1, 1, 5]))
    assert st["max_over_mean"] == pytest.approx(2.5)
    # CV = population std / mean: mean 2, squared deviations 1, 1, 1, 9 -> std sqrt(3), CV sqrt(3)/2
    assert st["cv"] == pytest.approx(math.sqrt(3) / 2)
    assert load_stats(torch.tensor([3, 3, 3]))["cv"] == 0.0
