"""k3.ops.distill_loss: both reverse-KL estimators against hand-computed numbers and a per-token
loop over the vocabulary; student = teacher gives 0 and a zero gradient (a student that differs,
the control, does not); the sampled-token estimate's mean over many samples is the exact KL; the
top-k form is the KL of the coarsened distributions, at most the exact one. The forward KL against
hand-computed numbers, torch's own ``kl_div`` and its analytic gradient π_s − π_t, and where the
two directions differ: a confidently wrong student."""

import math

import pytest
import torch

import torch.nn.functional as F

from k3.ops.distill_loss import forward_kl_exact, mixed_kl_exact, reverse_kl_exact, reverse_kl_sampled


def _kl_loop(p: list[float], q: list[float]) -> float:
    return sum(pi * (math.log(pi) - math.log(qi)) for pi, qi in zip(p, q))


def test_exact_reverse_kl_by_hand():
    # one position, 3 tokens: student (0.5, 0.25, 0.25), teacher (0.25, 0.5, 0.25)
    ps, pt = [0.5, 0.25, 0.25], [0.25, 0.5, 0.25]
    want = 0.5 * math.log(2) + 0.25 * math.log(0.5)          # = 0.25 · ln 2 = 0.1733
    assert _kl_loop(ps, pt) == pytest.approx(want)
    logits = torch.log(torch.tensor([ps]))
    loss, st = reverse_kl_exact(logits, torch.log(torch.tensor([pt])), torch.ones(1))
    assert float(loss) == pytest.approx(want, rel=1e-6) and st["tokens"] == 1.0
    # masked positions add nothing
    loss2, st2 = reverse_kl_exact(logits.repeat(2, 1), torch.log(torch.tensor([pt, ps])), torch.tensor([1.0, 0.0]))
    assert float(loss2) == pytest.approx(want, rel=1e-6) and st2["tokens"] == 1.0


def test_exact_matches_a_loop_and_its_gradient_matches_finite_differences():
    g = torch.Generator().manual_seed(0)
    s = torch.randn(2, 3, 7, generator=g, dtype=torch.float64)
    q = torch.log_softmax(torch.randn(2, 3, 7, generator=g, dtype=torch.float64), -1)
    m = torch.tensor([[1.0, 0.0, 1.0], [1.0, 1.0, 0.0]], dtype=torch.float64)
    loss, _ = reverse_kl_exact(s, q, m)
    ref = 0.0
    for b in range(2):
        for t in range(3):
            if m[b, t]:
                p = torch.softmax(s[b, t], -1).tolist()
                ref += _kl_loop(p, q[b, t].exp().tolist())
    assert float(loss) == pytest.approx(ref, rel=1e-6)
    x = s.clone().requires_grad_(True)
    torch.autograd.gradcheck(lambda z: reverse_kl_exact(z, q, m)[0].double(), (x,), eps=1e-6, atol=1e-5)


@pytest.mark.parametrize("form", ["exact", "sampled", "forward"])
def test_student_equal_to_teacher_gives_zero_loss_and_zero_gradient(form):
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 11, generator=g)
    lp_all = torch.log_softmax(logits, -1)
    tok = torch.randint(0, 11, (4,), generator=g)
    mask = torch.ones(4)

    def run(student_logits, teacher_lp):
        x = student_logits.clone().requires_grad_(True)
        s_all = torch.log_softmax(x, -1)
        if form == "exact":
            loss, _ = reverse_kl_exact(x, teacher_lp, mask)
        elif form == "forward":
            loss, _ = forward_kl_exact(x, teacher_lp, mask)
        else:
            lp = s_all.gather(-1, tok[:, None]).squeeze(-1)
            loss, _ = reverse_kl_sampled(lp, lp.detach(), teacher_lp.gather(-1, tok[:, None]).squeeze(-1), mask)
        loss.backward()
        return float(loss.detach()), float(x.grad.abs().max())

    loss, grad = run(logits, lp_all)
    assert abs(loss) < 1e-6 and grad < 1e-6
    # control: another teacher gives a loss and a gradient
    other = torch.log_softmax(logits + torch.randn(4, 11, generator=g), -1)
    loss, grad = run(logits, other)
    assert abs(loss) > 1e-3 and grad > 1e-3


def test_sampled_estimate_is_unbiased_for_the_exact_kl():
    """Over N samples x ~ π_s on a 6-token vocabulary, the mean of k = s(x) − q(x) is KL(π_s ‖ π_t)
    within 4 standard errors (the std of k measured from the same samples)."""
    g = torch.Generator().manual_seed(2)
    s = torch.log_softmax(torch.randn(6, generator=g) * 1.5, -1)
    q = torch.log_softmax(torch.randn(6, generator=g) * 1.5, -1)
    exact = _kl_loop(s.exp().tolist(), q.exp().tolist())
    n = 200_000
    x = torch.multinomial(s.exp(), n, replacement=True, generator=g)
    lp = s[x]
    loss, st = reverse_kl_sampled(lp, lp, q[x], torch.ones(n))
    mean = st["kl"] / n
    se = float((s[x] - q[x]).std()) / math.sqrt(n)
    assert abs(mean - exact) <= 4 * se, (mean, exact, se)
    assert se < 0.01 * exact       # the bound is tight enough to mean something
    # its gradient is k_t · ∇s(x_t): for a student parameterised by its logits, the mean over the
    # samples is the exact KL's gradient (within the sampling noise)
    z = s.clone().requires_grad_(True)
    lpz = torch.log_softmax(z, -1)[x]
    reverse_kl_sampled(lpz, lpz.detach(), q[x], torch.ones(n))[0].div(n).backward()
    zx = s.clone().requires_grad_(True)
    reverse_kl_exact(zx[None], q[None], torch.ones(1))[0].backward()
    assert torch.allclose(z.grad, zx.grad, atol=0.02), (z.grad, zx.grad)


def test_top_k_is_the_kl_of_the_coarsened_distributions():
    ps = torch.tensor([0.4, 0.3, 0.2, 0.1])
    pt = torch.tensor([0.1, 0.2, 0.3, 0.4])
    loss, _ = reverse_kl_exact(torch.log(ps)[None], torch.log(pt)[None], torch.ones(1), top_k=2)
    # the student's top 2 are tokens 0 and 1; tails: student 0.3, teacher 0.7
    want = _kl_loop([0.4, 0.3, 0.3], [0.1, 0.2, 0.7])
    assert float(loss) == pytest.approx(want, rel=1e-5)
    full, _ = reverse_kl_exact(torch.log(ps)[None], torch.log(pt)[None], torch.ones(1))
    assert float(loss) <= float(full)
    with pytest.raises(ValueError, match="top_k"):
        reverse_kl_exact(torch.log(ps)[None], torch.log(pt)[None], torch.ones(1), top_k=4)


def test_shapes_are_checked():
    with pytest.raises(ValueError, match="teacher_logprobs shape"):
        reverse_kl_exact(torch.zeros(2, 5), torch.zeros(2, 4), torch.ones(2))
    with pytest.raises(ValueError, match="teacher_logp shape"):
        reverse_kl_sampled(torch.zeros(3), torch.zeros(3), torch.zeros(2), torch.ones(3))


def test_forward_kl_by_hand_against_torch_kl_div_and_its_analytic_gradient():
    # one position: student (0.5, 0.3, 0.2), teacher (0.2, 0.5, 0.3); KL(t || s) by hand
    ps, pt = [0.5, 0.3, 0.2], [0.2, 0.5, 0.3]
    want = 0.2 * math.log(0.2 / 0.5) + 0.5 * math.log(0.5 / 0.3) + 0.3 * math.log(0.3 / 0.2)
    assert _kl_loop(pt, ps) == pytest.approx(want)
    loss, st = forward_kl_exact(torch.log(torch.tensor([ps])), torch.log(torch.tensor([pt])), torch.ones(1))
    assert float(loss) == pytest.approx(want, rel=1e-6) and st["tokens"] == 1.0
    rev, _ = reverse_kl_exact(torch.log(torch.tensor([ps])), torch.log(torch.tensor([pt])), torch.ones(1))
    assert abs(float(rev) - want) > 1e-3    # the directions differ on this example
    g = torch.Generator().manual_seed(3)
    s = torch.randn(2, 3, 9, generator=g, dtype=torch.float64)
    q = torch.log_softmax(torch.randn(2, 3, 9, generator=g, dtype=torch.float64), -1)
    m = torch.tensor([[1.0, 0.0, 1.0], [0.0, 1.0, 1.0]], dtype=torch.float64)
    x = s.clone().requires_grad_(True)
    loss, st = forward_kl_exact(x, q, m)
    ref = (F.kl_div(torch.log_softmax(s, -1), q, log_target=True, reduction="none").sum(-1) * m).sum()
    assert float(loss.detach()) == pytest.approx(float(ref), rel=1e-9) and st["tokens"] == 4.0
    loss.backward()
    assert torch.allclose(x.grad, (torch.softmax(s, -1) - q.exp()) * m[..., None], atol=1e-12)
    top, _ = forward_kl_exact(s, q, m, top_k=3)
    assert float(top) <= float(loss)    # coarsening never adds divergence


def test_forward_top_k_is_the_kl_of_the_coarsened_distributions():
    ps = torch.tensor([0.4, 0.3, 0.2, 0.1])
    pt = torch.tensor([0.1, 0.2, 0.3, 0.4])
    loss, _ = forward_kl_exact(torch.log(ps)[None], torch.log(pt)[None], torch.ones(1), top_k=2)
    assert float(loss) == pytest.approx(_kl_loop([0.1, 0.2, 0.7], [0.4, 0.3, 0.3]), rel=1e-5)
    with pytest.raises(ValueError, match="top_k"):
        forward_kl_exact(torch.log(ps)[None], torch.log(pt)[None], torch.ones(1), top_k=0)


def test_a_confidently_wrong_student_gets_a_vanishing_reverse_gradient_and_a_full_forward_one():
    """The reason for ``--forward-weight``: the student puts 0.9999 on token 0, the teacher 0.98 on
    token 1. The reverse KL is large (about 4.6, −ln 0.01) but its largest gradient is under 0.01; the forward KL's is
    π_s − π_t, about 1 on both tokens. The control: a student unsure between the tokens gets a
    reverse gradient of the same order as the forward one."""
    q = torch.log(torch.tensor([[0.01, 0.98, 0.01]]))

    def grads(logits):
        out = []
        for fn in (reverse_kl_exact, forward_kl_exact):
            x = logits.clone().requires_grad_(True)
            loss, _ = fn(x, q, torch.ones(1))
            loss.backward()
            out.append((float(loss.detach()), float(x.grad.abs().max())))
        return out

    (rev, g_rev), (_, g_fwd) = grads(torch.tensor([[12.0, 2.8, 0.0]]))
    assert rev > 4 and g_rev < 0.01 and g_fwd > 0.9
    (_, g_rev), (_, g_fwd) = grads(torch.tensor([[0.0, 0.0, -3.0]]))
    assert g_rev > 0.1 and g_fwd > 0.1


@pytest.mark.parametrize("top_k", [None, 3])
def test_the_mixture_is_the_weighted_sum_of_both_directions_with_the_reverse_kl_reported(top_k):
    g = torch.Generator().manual_seed(4)
    s = torch.randn(2, 3, 9, generator=g, dtype=torch.float64)
    q = torch.log_softmax(torch.randn(2, 3, 9, generator=g, dtype=torch.float64), -1)
    m = torch.tensor([[1.0, 0.0, 1.0], [1.0, 1.0, 0.0]], dtype=torch.float64)
    rev, st_rev = reverse_kl_exact(s, q, m, top_k)
    fwd, _ = forward_kl_exact(s, q, m, top_k)
    for w in (0.0, 0.3, 1.0):
        mix, st = mixed_kl_exact(s, q, m, top_k, w)
        assert float(mix) == pytest.approx((1 - w) * float(rev) + w * float(fwd), rel=1e-12)
        assert st == st_rev
