"""KDA's single-token decode step (``_decode_step``) against the general path and a per-token loop."""

import pytest
import torch
import torch.nn.functional as F

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


def decode(m, x, prefill, fast):
    """Prefill x[:, :prefill] then feed the rest one token at a time -> outputs of the decode steps."""
    m.fast_decode = fast
    st = KDAState(x.shape[0], m.num_heads, m.head_dim, m.conv_kernel_size)
    with torch.no_grad():
        if prefill:
            m(x[:, :prefill], st)
        out = torch.cat([m(x[:, t:t + 1], st) for t in range(prefill, x.shape[1])], 1)
    return out, st


@pytest.mark.parametrize("mode", [dict(), dict(lower_bound=None), dict(full_rank=False), dict(kernel=1),
                                  dict(kernel=2)])
@pytest.mark.parametrize("prefill", [0, 5])
def test_decode_step_matches_general_path_and_one_pass(mode, prefill):
    m = _layer(**mode)
    x = torch.randn(3, 11, m.hidden_size)
    fast, st_fast = decode(m, x, prefill, True)
    slow, st_slow = decode(m, x, prefill, False)
    with torch.no_grad():
        full = m(x)[:, prefill:]                      # one pass, no state (chunked KDA)
    assert rel(fast, slow) < 1e-5 and rel(fast, full) < 1e-5
    torch.testing.assert_close(st_fast.recurrent, st_slow.recurrent, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(st_fast.conv, st_slow.conv)
    assert st_fast.conv.shape == (3, 3 * m.num_heads * m.head_dim, m.conv_kernel_size - 1)


def test_decode_step_bf16_tracks_fp32():
    m = _layer(seed=1)
    x = torch.randn(2, 9, m.hidden_size)
    want, _ = decode(m, x, 4, True)
    m.to(torch.bfloat16)
    got, st = decode(m, x.bfloat16(), 4, True)
    assert got.dtype == torch.bfloat16 and st.recurrent.dtype == torch.float32
    assert st.conv.dtype == torch.bfloat16
    assert rel(got.float(), want) < 3e-2


def test_decode_step_is_differentiable():
    """Not the training path, but a caller may still take gradients through a cached step."""
    m = _layer(seed=2).double()
    x = torch.randn(1, 4, m.hidden_size, dtype=torch.float64)
    grads = {}
    for fast in (True, False):
        m.fast_decode = fast
        m.zero_grad()
        st = KDAState(1, m.num_heads, m.head_dim, m.conv_kernel_size)
        with torch.no_grad():
            m(x[:, :3], st)
        m(x[:, 3:], st).pow(2).sum().backward()
        grads[fast] = [p.grad.clone() for p in m.parameters() if p.grad is not None]
    assert len(grads[True]) == len(grads[False]) > 0
    for a, b in zip(grads[True], grads[False]):
        assert rel(a, b) < 1e-6   # both run the recurrence in fp32
