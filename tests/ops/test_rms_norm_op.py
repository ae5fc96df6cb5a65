"""RMSNorm's gradients: the C op (``k3::rms_norm``) and the torch form, each against float64 autograd of
the formula written out here, at row counts around the op's 64-row blocks; a row's values alone and
beside others, and the weight's gradient at 1 and 2 threads."""

from __future__ import annotations

import pytest
import torch

from k3.ops import norm as norm_mod
from k3.ops.norm import rms_norm


def formula64(x, w, eps):
    x, w = x.double(), w.double()
    return w * x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)


def _run(fn, x, w, dy, dtype=torch.float32):
    xs, ws = (t.detach().to(dtype, copy=True).requires_grad_(True) for t in (x, w))
    y = fn(xs, ws)
    (y.double() * dy.double()).sum().backward()
    return y, xs.grad, ws.grad


def _inputs(shape, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=gen) * torch.rand(*shape[:-1], 1, generator=gen) * 5
    return x, torch.rand(shape[-1], generator=gen) + 0.5, torch.randn(*shape, generator=gen)


@pytest.mark.parametrize("shape", [(1, 7), (63, 16), (64, 33), (65, 256), (3, 50, 40)])
def test_output_and_gradients_match_float64(shape, path, autograd_nodes):
    x, w, dy = _inputs(shape, seed=sum(shape))
    y, dx, dw = _run(lambda a, b: rms_norm(a, b, 1e-5), x, w, dy)
    assert any("rms_norm" in n for n in autograd_nodes(y)) == (path == "c"), autograd_nodes(y)
    ref, rx, rw = _run(lambda a, b: formula64(a, b, 1e-5), x, w, dy, torch.float64)
    torch.testing.assert_close(y.double(), ref, atol=1e-5, rtol=1e-5)
    for name, a, b in (("x", dx, rx), ("weight", dw, rw)):
        assert (a.double() - b).abs().max() <= 1e-5 * b.abs().max(), name


def test_no_grad_forward_is_the_same_op():
    x, w, _ = _inputs((5, 24), seed=1)
    with torch.no_grad():
        a = rms_norm(x, w, 1e-6)
    assert torch.equal(a, rms_norm(x, w, 1e-6).detach())


def test_rows_are_independent_and_threads_do_not_matter(at_1_and_2_threads):
    x, w, dy = _inputs((200, 96), seed=4)
    one, two = at_1_and_2_threads(lambda: _run(lambda a, b: rms_norm(a, b, 1e-5), x, w, dy))
    assert all(torch.equal(a, b) for a, b in zip(one, two))
    alone = _run(lambda a, b: rms_norm(a, b, 1e-5), x[70:71], w, dy[70:71])
    assert torch.equal(alone[0], one[0][70:71]) and torch.equal(alone[1], one[1][70:71])
    # the weight's gradient over two halves (as two data-parallel ranks sum it) is the whole's to rounding
    half = [_run(lambda a, b: rms_norm(a, b, 1e-5), x[s], w, dy[s])[2] for s in (slice(0, 100), slice(100, 200))]
    torch.testing.assert_close(half[0] + half[1], one[2], rtol=1e-5, atol=1e-5)


def test_direct_calls_with_the_wrong_layout_are_refused():
    x, w, dy = _inputs((4, 8), seed=2)
    y, rinv = norm_mod._norm_op(x, w, 1e-5)                                      # control
    assert y.shape == x.shape and rinv.shape == (4,)
    with pytest.raises(ValueError, match=r"k3::rms_norm: weight: expected a contiguous fp32 CPU tensor \[8\]"):
        norm_mod._norm_op(x, w[:7], 1e-5)
    with pytest.raises(ValueError, match=r"k3::rms_norm: x must be \[M, D\]"):
        norm_mod._norm_op(x[0], w, 1e-5)
    with pytest.raises(ValueError, match=r"k3::rms_norm_backward: rinv"):
        norm_mod._norm_bwd_op(x, w, rinv[:3], dy)
    with pytest.raises(ValueError, match=r"k3::rms_norm_backward: dy"):
        norm_mod._norm_bwd_op(x, w, rinv, dy.t())
