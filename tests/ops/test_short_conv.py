"""KDA's short convolution with SiLU: the C op (``k3::short_conv_silu``) and the conv1d formulation, each
against a per-token, per-tap loop in float64 (outputs and the gradients of x, the taps and the context)."""

from __future__ import annotations

import pytest
import torch

from k3.ops.short_conv import short_conv_silu


def loop64(x, w, prev):
    """y[b, t, c] = SiLU(Σ_k w[c, k] · xx[b, t − (K−1) + k, c]) token by token, tap by tap."""
    B, T, C = x.shape
    K = w.shape[1]
    x, w = x.double(), w.double()
    ctx = torch.zeros(B, C, K - 1, dtype=torch.float64) if prev is None else prev.double()
    rows = []
    for t in range(T):
        z = torch.zeros(B, C, dtype=torch.float64)
        for k in range(K):
            s = t - (K - 1) + k
            z = z + w[:, k] * (x[:, s] if s >= 0 else ctx[:, :, K - 1 + s])
        rows.append(z * torch.sigmoid(z))
    return torch.stack(rows, 1)


def _inputs(B, T, C, K, with_prev, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x, w = torch.randn(B, T, C, generator=gen), 0.5 * torch.randn(C, K, generator=gen)
    prev = torch.randn(B, C, K - 1, generator=gen) if with_prev else None
    return x, w, prev, torch.randn(B, T, C, generator=gen)


def _run(fn, x, w, prev, dy, dtype=torch.float32):
    xs = [None if t is None else t.detach().to(dtype, copy=True).requires_grad_(True) for t in (x, w, prev)]
    y = fn(*xs)
    (y.double() * dy.double()).sum().backward()
    return y, [None if t is None else t.grad for t in xs]


@pytest.mark.parametrize("T", [1, 2, 70, 130])
@pytest.mark.parametrize("with_prev", [False, True])
def test_conv_and_its_gradients_match_the_float64_loop(T, with_prev, path):
    x, w, prev, dy = _inputs(2, T, 40, 4, with_prev, seed=T)
    y, grads = _run(short_conv_silu, x, w, prev, dy)
    assert ("short_conv_silu" in type(y.grad_fn).__name__) == (path == "c"), y.grad_fn
    ref, want = _run(loop64, x, w, prev, dy, torch.float64)
    assert y.shape == x.shape and y.dtype == torch.float32
    torch.testing.assert_close(y.double(), ref, atol=1e-5, rtol=1e-5)
    for name, a, b in zip(("x", "w", "prev"), grads, want):
        if b is None:
            assert a is None
            continue
        assert (a.double() - b).abs().max() <= 1e-5 * b.abs().max(), name


def test_c_conv_does_not_depend_on_threads_or_other_rows(at_1_and_2_threads):
    x, w, prev, dy = _inputs(3, 150, 96, 4, True, seed=5)
    one, two = at_1_and_2_threads(lambda: _run(short_conv_silu, x, w, prev, dy))
    assert torch.equal(one[0], two[0]) and all(torch.equal(a, b) for a, b in zip(one[1], two[1]))
    # a row alone gives its bits beside the others (the taps' gradient sums over rows, so not that)
    alone = _run(short_conv_silu, x[1:2], w, prev[1:2], dy[1:2])
    assert torch.equal(alone[0], one[0][1:2]) and torch.equal(alone[1][0], one[1][0][1:2])


@pytest.mark.parametrize("K", [1, 2, 6])
def test_other_widths(K):
    x, w, prev, dy = _inputs(1, 33, 17, K, True, seed=K)
    y, grads = _run(short_conv_silu, x, w, prev, dy)
    ref, want = _run(loop64, x, w, prev, dy, torch.float64)
    torch.testing.assert_close(y.double(), ref, atol=1e-5, rtol=1e-5)
    for a, b in zip(grads, want):
        if b is None:                       # K = 1: no left context, so prev [B, C, 0] is unused
            assert K == 1 and a.numel() == 0
            continue
        assert (a.double() - b).abs().max() <= 1e-5 * b.abs().max()


def test_bf16_takes_the_conv1d_formulation():
    x, w, prev, dy = _inputs(2, 20, 16, 4, True, seed=9)
    y, grads = _run(short_conv_silu, x, w, prev, dy, torch.bfloat16)
    assert y.dtype == torch.bfloat16 and "short_conv_silu" not in type(y.grad_fn).__name__
    ref = loop64(x.bfloat16(), w.bfloat16(), prev.bfloat16())
    assert (y.double() - ref).abs().max() <= 2e-2 * ref.abs().max()


@pytest.mark.parametrize("bad,match", [
    (lambda x, w, p: (x[0], w, p), "x must"),
    (lambda x, w, p: (x, w[:3], p), "w must"),
    (lambda x, w, p: (x, w, p[:, :, :1]), "prev must"),
])
def test_bad_shapes_name_the_tensor(bad, match):
    x, w, prev, _ = _inputs(2, 5, 8, 4, True)
    with pytest.raises(ValueError, match=match):
        short_conv_silu(*bad(x, w, prev))
    assert short_conv_silu(x, w, prev).shape == x.shape        # control: the same call, well-formed
