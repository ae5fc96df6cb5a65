"""The gated activations (SiTU, SwiGLU): the C op (``k3::gated_act``) and the torch forms, each against
the formula written out here in float64, for the output and both gradients."""

from __future__ import annotations

import math

import pytest
import torch

from k3.ops import situ
from k3.ops.situ import gated_act


def formula64(g, u, silu, beta, linear_beta):
    """The activation element by element from its definition (SPEC §3.4), in float64."""
    g, u = g.double(), u.double()
    if silu:
        return g / (1 + torch.exp(-g)) * u
    gate = beta * torch.tanh(g / beta) / (1 + torch.exp(-g))
    return gate * (u if linear_beta is None else linear_beta * torch.tanh(u / linear_beta))


def _run(fn, g, u, dy, dtype=torch.float32):
    gs, us = (t.detach().to(dtype, copy=True).requires_grad_(True) for t in (g, u))
    y = fn(gs, us)
    (y.double() * dy.double()).sum().backward()
    return y, gs.grad, us.grad


def _inputs(shape, seed=0, scale=3.0):
    gen = torch.Generator().manual_seed(seed)
    return tuple(scale * torch.randn(*shape, generator=gen) for _ in range(3))


KINDS = [(True, 4.0, None), (False, 4.0, 25.0), (False, 4.0, None), (False, 1.5, 2.0)]


@pytest.mark.parametrize("silu,beta,lin", KINDS)
@pytest.mark.parametrize("shape", [(1,), (7, 13), (3, 40, 33), (4096 + 17,)])
def test_activation_and_gradients_match_the_float64_formula(silu, beta, lin, shape, path):
    g, u, dy = _inputs(shape, seed=len(shape))
    y, dg, du = _run(lambda a, b: gated_act(a, b, silu, beta, lin), g, u, dy)
    assert ("gated_act" in type(y.grad_fn).__name__) == (path == "c"), y.grad_fn
    ref, rg, ru = _run(lambda a, b: formula64(a, b, silu, beta, lin), g, u, dy, torch.float64)
    assert y.shape == g.shape and y.dtype == torch.float32
    torch.testing.assert_close(y.double(), ref, atol=1e-5, rtol=1e-5)
    for name, a, b in (("g", dg, rg), ("u", du, ru)):
        assert (a.double() - b).abs().max() <= 1e-5 * b.abs().max(), name


def test_large_inputs_stay_finite_and_saturate():
    """SiTU is bounded: at |g|, |u| = 1e4 the output is ±β·β_lin (or 0 for g → −∞) and the gradients 0."""
    g = torch.tensor([1e4, -1e4, 1e4, 80.0]).requires_grad_(True)
    u = torch.tensor([1e4, 1e4, -1e4, 0.5]).requires_grad_(True)
    y = gated_act(g, u, False, 4.0, 25.0)
    y.sum().backward()
    assert torch.isfinite(y).all() and torch.isfinite(g.grad).all() and torch.isfinite(u.grad).all()
    torch.testing.assert_close(y[:3], torch.tensor([100.0, 0.0, -100.0]))
    torch.testing.assert_close(y[3], torch.tensor(4 * math.tanh(20) * 25 * math.tanh(0.02)))


def test_c_op_does_not_depend_on_threads_or_position(at_1_and_2_threads):
    g, u, dy = _inputs((5, 3000), seed=3)
    fn = lambda: _run(lambda a, b: gated_act(a, b, False, 4.0, 25.0), g, u, dy)  # noqa: E731
    one, two = at_1_and_2_threads(fn)
    assert all(torch.equal(a, b) for a, b in zip(one, two))
    # a slice alone (other length, other offset in its 16-wide vectors) gives the same bits
    alone = _run(lambda a, b: gated_act(a, b, False, 4.0, 25.0), g[2, 5:1234], u[2, 5:1234], dy[2, 5:1234])
    assert all(torch.equal(a, b[2, 5:1234]) for a, b in zip(alone, one))


def test_strided_views_and_bf16():
    """Column slices of a fused [N, 2F] output go through the op (copied); bf16 takes the torch form."""
    gen = torch.Generator().manual_seed(1)
    h = torch.randn(9, 2 * 24, generator=gen)
    y = gated_act(h[:, :24], h[:, 24:], True)
    torch.testing.assert_close(y.double(), formula64(h[:, :24], h[:, 24:], True, 4.0, None))
    hb = h.bfloat16().requires_grad_(True)
    yb = gated_act(hb[:, :24], hb[:, 24:], False, 4.0, 25.0)
    assert yb.dtype == torch.bfloat16 and yb.grad_fn is not None and "gated_act" not in type(yb.grad_fn).__name__
    torch.testing.assert_close(yb.double(), formula64(hb[:, :24], hb[:, 24:], False, 4.0, 25.0), atol=0.1, rtol=0.02)


def test_bad_shapes_and_direct_calls_are_refused():
    g, u, dy = _inputs((4, 8))
    assert situ._glu_op(g, u, False, 4.0, 25.0).shape == g.shape                 # control
    with pytest.raises(ValueError, match="one shape"):
        gated_act(g, u[:, :7], True)
    with pytest.raises(ValueError, match=r"k3::gated_act: u: expected a contiguous fp32"):
        situ._glu_op(g, u.t().contiguous(), False, 4.0, 25.0)
    with pytest.raises(ValueError, match=r"k3::gated_act: g: expected a contiguous fp32"):
        situ._glu_op(g.double(), u, False, 4.0, 25.0)
    with pytest.raises(ValueError, match=r"k3::gated_act_backward: dy"):
        situ._glu_bwd_op(g, u, dy[:, ::2], False, 4.0, 25.0)
    with pytest.raises(ValueError, match="linear_beta"):
        situ._glu_op(g, u, False, 4.0, -1.0)
    with pytest.raises(ValueError, match="beta > 0"):
        gated_act(g, u, False, 0.0, 25.0)


def test_compiles_through_make_fx():
    from torch.fx.experimental.proxy_tensor import make_fx
    g, u, _ = _inputs((3, 32))
    gm = make_fx(lambda a, b: gated_act(a, b, False, 4.0, 25.0))(g, u)
    assert any("gated_act" in str(n.target) for n in gm.graph.nodes)
    torch.testing.assert_close(gm(g, u), gated_act(g, u, False, 4.0, 25.0))
