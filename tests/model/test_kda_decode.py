"""KDA's cached single-token steps (the recurrent form) against one pass over the same tokens
(the chunked form), in fp32 and bf16, and their gradient against a finite difference."""

import pytest
import torch

from k3.config import get_preset
from k3.model.cache import KDAState
from k3.model.kda import KimiDeltaAttention


def _layer(seed=0, lower_bound=-5.0, full_rank=True, kernel=4):
    cfg = get_preset("nano")
    lac = cfg.linear_attn_config.to_dict()
    lac.update(num_heads=2, head_dim=16, short_conv_kernel_size=kernel, gate_lower_bound=lower_bound,
               use_full_rank_gate=full_rank)
    torch.manual_seed(seed)
    m = KimiDeltaAttention(cfg.replace(linear_attn_config=lac), layer_idx=0)
    with torch.no_grad():
        m.o_norm.weight.uniform_(0.5, 1.5)
        m.f_b_proj.weight.mul_(10)
    return m


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def decode(m, x, prefill):
    """Prefill x[:, :prefill] then feed the rest one token at a time -> outputs of the decode steps."""
    st = KDAState(x.shape[0], m.num_heads, m.head_dim, m.conv_kernel_size)
    with torch.no_grad():
        if prefill:
            m(x[:, :prefill], st)
        out = torch.cat([m(x[:, t:t + 1], st) for t in range(prefill, x.shape[1])], 1)
    return out, st


@pytest.mark.parametrize("mode", [dict(), dict(lower_bound=None), dict(full_rank=False), dict(kernel=1),
                                  dict(kernel=2)])
@pytest.mark.parametrize("prefill", [0, 5])
def test_decode_steps_match_one_pass(mode, prefill):
    m = _layer(**mode)
    x = torch.randn(3, 11, m.hidden_size)
    got, st = decode(m, x, prefill)
    one = KDAState(3, m.num_heads, m.head_dim, m.conv_kernel_size)
    with torch.no_grad():
        full = m(x, one)                              # one pass with a state (chunked KDA)
    assert rel(got, full[:, prefill:]) < 1e-5
    torch.testing.assert_close(st.recurrent, one.recurrent, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(st.conv, one.conv)
    assert st.conv.shape == (3, 3 * m.num_heads * m.head_dim, m.conv_kernel_size - 1)


def test_decode_step_bf16_tracks_fp32():
    m = _layer(seed=1)
    x = torch.randn(2, 9, m.hidden_size)
    want, _ = decode(m, x, 4)
    m.to(torch.bfloat16)
    got, st = decode(m, x.bfloat16(), 4)
    assert got.dtype == torch.bfloat16 and st.recurrent.dtype == torch.float32
    assert st.conv.dtype == torch.bfloat16
    assert rel(got.float(), want) < 3e-2


def test_a_cached_step_is_differentiable_and_its_gradient_is_the_finite_difference():
    """Not the training path, but a caller may take gradients through a cached step: along a random
    unit direction d in parameter space, <grad, d> equals (L(θ + εd) − L(θ − εd)) / 2ε (float64
    weights, fp32 gates and recurrence)."""
    m = _layer(seed=2).double()
    x = torch.randn(1, 4, m.hidden_size, dtype=torch.float64)
    params = [p for p in m.parameters()]
    g = torch.Generator().manual_seed(3)
    d = [torch.randn(p.shape, generator=g, dtype=p.dtype) for p in params]
    norm = sum(v.pow(2).sum() for v in d).sqrt()
    d = [v / norm for v in d]                                    # a unit direction

    prefilled = KDAState(1, m.num_heads, m.head_dim, m.conv_kernel_size)
    with torch.no_grad():
        m(x[:, :3], prefilled)        # the cached state: a constant of the step (no gradient reaches it)

    def loss():
        return m(x[:, 3:], prefilled.clone()).pow(2).sum()

    m.zero_grad()
    loss().backward()
    assert all(p.grad is not None for p in params)
    analytic = sum((p.grad * v).sum() for p, v in zip(params, d)).item()
    eps = 1e-2   # the gates and the recurrence run in fp32 even here: a step well above their rounding
    with torch.no_grad():
        vals = []
        for sign in (1, -1):
            for p, v in zip(params, d):
                p.add_(sign * eps * v)
            vals.append(loss().item())
            for p, v in zip(params, d):
                p.sub_(sign * eps * v)
    numeric = (vals[0] - vals[1]) / (2 * eps)
    assert abs(analytic) > 1e-3                                  # a real gradient
    assert abs(analytic - numeric) <= 1e-4 * abs(numeric)     # measured 3e-5 (fp32 rounding)
