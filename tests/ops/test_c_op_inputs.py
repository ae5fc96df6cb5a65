"""The C custom ops (torch.ops.k3.*) read their tensors through raw pointers: called directly with a
tensor of the wrong dtype, layout or shape they refuse it, naming the op and the argument, while the
same call with well-formed tensors runs."""

from __future__ import annotations

import pytest
import torch

from k3.ops import attn_res, kda, short_conv


def _kda_args(B=1, T=9, H=2, K=8, V=4):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(B, T, H, K, generator=g), torch.randn(B, T, H, K, generator=g),
            torch.randn(B, T, H, V, generator=g), -torch.rand(B, T, H, K, generator=g),
            torch.rand(B, T, H, generator=g), torch.randn(B, H, K, V, generator=g)]


@pytest.mark.parametrize("i,bad,match", [
    (0, lambda t: t.double(), r"q: expected a contiguous fp32 CPU tensor \[1, 9, 2, 8\]"),
    (1, lambda t: t.transpose(1, 2).contiguous().transpose(1, 2), "k: expected a contiguous"),
    (2, lambda t: t.transpose(0, 1), "v must be"), (4, lambda t: t[:, :, :1].contiguous(), "beta must be"),
    (5, lambda t: t[:, :1].contiguous(), "initial_state must be")])
def test_kda_scan_refuses_a_malformed_tensor(i, bad, match):
    args = _kda_args()
    o, S, ckpt = kda._kda_scan_op(*args, 0.5, 4)                     # control: well-formed
    assert o.shape == (1, 9, 2, 4) and ckpt.shape == (1, 2, 3, 8, 4)
    args[i] = bad(args[i])
    with pytest.raises(ValueError, match="k3::kda_scan: " + match):
        kda._kda_scan_op(*args, 0.5, 4)


def test_kda_scan_backward_refuses_checkpoints_of_another_interval():
    q, k, v, g, beta, s0 = _kda_args()
    _, _, ckpt = kda._kda_scan_op(q, k, v, g, beta, s0, 0.5, 4)
    do = torch.ones_like(v)
    assert kda._kda_scan_bwd_op(q, k, v, g, beta, ckpt, do, None, 0.5, 4)[0].shape == q.shape
    with pytest.raises(ValueError, match="ckpt: expected a contiguous"):
        kda._kda_scan_bwd_op(q, k, v, g, beta, ckpt, do, None, 0.5, 2)


def test_attn_res_mix_refuses_mismatched_sources():
    srcs, q = [torch.randn(3, 8), torch.randn(3, 8)], torch.randn(8)
    assert attn_res._mix_op(srcs, q, 0.1)[0].shape == (3, 8)           # control
    with pytest.raises(ValueError, match=r"sources\[1\]: expected a contiguous"):
        attn_res._mix_op([srcs[0], torch.randn(2, 8)], q, 0.1)
    with pytest.raises(ValueError, match="q: expected a contiguous"):
        attn_res._mix_op(srcs, torch.randn(7), 0.1)
    with pytest.raises(ValueError, match=r"sources\[0\]: expected a contiguous"):
        attn_res._mix_op([s.double() for s in srcs], q, 0.1)


def test_short_conv_refuses_mismatched_taps_and_context():
    x, w_t, prev = torch.randn(2, 5, 6), torch.randn(4, 6), torch.randn(2, 6, 3)
    assert short_conv._conv_op(x, w_t, prev).shape == x.shape          # control
    with pytest.raises(ValueError, match="w_t: expected a contiguous"):
        short_conv._conv_op(x, torch.randn(4, 5), prev)
    with pytest.raises(ValueError, match="prev: expected a contiguous"):
        short_conv._conv_op(x, w_t, torch.randn(2, 6, 2))
    with pytest.raises(ValueError, match="x: expected a contiguous"):
        short_conv._conv_op(x.transpose(0, 1), w_t, None)
    with pytest.raises(ValueError, match="x must be"):
        short_conv._conv_op(x[0], w_t, None)


def test_kda_scan_refuses_a_tensor_of_the_wrong_rank():
    args = _kda_args()
    args[0] = args[0][0]
    with pytest.raises(ValueError, match="k3::kda_scan: q must be"):
        kda._kda_scan_op(*args, 0.5, 4)
