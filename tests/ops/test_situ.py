"""SiTU gated activation against its formula (SPEC §3.4), incl. extreme inputs and gradients."""

import math

import pytest
import torch

from k3.config import get_preset
from k3.ops.situ import glu_act, situ_glu, swiglu


def situ_ref(g, u, beta=4.0, lin=25.0):
    """Elementwise in float64 with math functions."""
    def one(a, b):
        gate = beta * math.tanh(a / beta) / (1 + math.exp(-a)) if a > -700 else 0.0
        up = b if lin is None else lin * math.tanh(b / lin)
        return gate * up
    return torch.tensor([[one(a, b) for a, b in zip(ra, rb)] for ra, rb in zip(g.tolist(), u.tolist())],
                        dtype=torch.float64)


@pytest.mark.parametrize("beta,lin", [(4.0, 25.0), (4.0, None), (2.0, 10.0)])
def test_situ_matches_formula(beta, lin):
    torch.manual_seed(0)
    g, u = torch.randn(6, 10) * 5, torch.randn(6, 10) * 30
    out = situ_glu(g, u, beta, lin)
    torch.testing.assert_close(out.double(), situ_ref(g, u, beta, lin), rtol=1e-5, atol=1e-5)


def test_situ_is_bounded_and_finite_at_large_inputs():
    big = torch.tensor([-1e4, -1e3, -50.0, 50.0, 1e3, 1e4])
    g, u = big.repeat_interleave(6).view(6, 6), big.repeat(6).view(6, 6)
    g.requires_grad_(True)
    u.requires_grad_(True)
    out = situ_glu(g, u)
    assert torch.isfinite(out).all()
    assert out.abs().max() <= 4.0 * 25.0 + 1e-3  # |gate| < β, |up| < β_lin
    torch.testing.assert_close(out.double(), situ_ref(g.detach(), u.detach()), rtol=1e-5, atol=1e-5)
    # saturation: g → +∞ gives β·β_lin·tanh(u/β_lin) → ±100; g → −∞ gives 0
    assert out[-1, -1].item() == pytest.approx(100.0, rel=1e-4)
    assert out[0].abs().max().item() < 1e-3
    out.sum().backward()
    assert torch.isfinite(g.grad).all() and torch.isfinite(u.grad).all()
    assert not torch.isnan(g.grad).any()


def test_situ_gradients_match_float64_formula():
    torch.manual_seed(1)
    g = (torch.randn(5, 7) * 4).requires_grad_()
    u = (torch.randn(5, 7) * 40).requires_grad_()
    g64, u64 = g.detach().double().requires_grad_(), u.detach().double().requires_grad_()
    ref = 4 * torch.tanh(g64 / 4) * torch.sigmoid(g64) * 25 * torch.tanh(u64 / 25)
    gy = torch.randn(5, 7)
    ga = torch.autograd.grad(situ_glu(g, u), (g, u), gy)
    gb = torch.autograd.grad(ref, (g64, u64), gy.double())
    for a, b in zip(ga, gb):
        torch.testing.assert_close(a.double(), b, rtol=1e-5, atol=1e-5)


def test_situ_computes_in_fp32_and_returns_input_dtype():
    g, u = torch.randn(4, 8).bfloat16(), torch.randn(4, 8).bfloat16()
    out = situ_glu(g, u)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, situ_glu(g.float(), u.float()).bfloat16())


def test_swiglu_and_glu_act_selection():
    g, u = torch.randn(3, 4), torch.randn(3, 4)
    torch.testing.assert_close(swiglu(g, u), g * torch.sigmoid(g) * u)
    silu_cfg = get_preset("nano", hidden_act="silu")
    torch.testing.assert_close(glu_act(silu_cfg)(g, u), g * torch.sigmoid(g) * u)
    cfg = get_preset("nano", activation_situ_beta=3.0, activation_situ_linear_beta=None)
    torch.testing.assert_close(glu_act(cfg)(g, u).double(), situ_ref(g, u, 3.0, None), rtol=1e-5, atol=1e-6)
