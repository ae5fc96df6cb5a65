"""Cross-entropy over the vocabulary: the C op (``k3::cross_entropy``) and F.cross_entropy, each against
the definition written out here in float64 (a row at a time), for the loss and the logits' gradient."""

from __future__ import annotations

import math

import pytest
import torch

from k3.ops import loss as loss_mod
from k3.ops.loss import cross_entropy


def rows64(z, y, ignore):
    """loss_i = log Σ_j exp z_ij − z_i,y_i for each kept row, from the definition, in float64."""
    out = []
    for zi, yi in zip(z.double(), y.tolist()):
        out.append(torch.zeros((), dtype=torch.float64) if yi == ignore
                   else torch.log(torch.exp(zi - zi.max()).sum()) + zi.max() - zi[yi])
    return torch.stack(out)


def ref64(z, y, ignore, reduction):
    r = rows64(z, y, ignore)
    kept = sum(1 for v in y.tolist() if v != ignore)
    return r if reduction == "none" else r.sum() if reduction == "sum" else r.sum() / kept


def _case(N, V, seed, ignore=-100, n_ignored=0, scale=4.0):
    gen = torch.Generator().manual_seed(seed)
    z = scale * torch.randn(N, V, generator=gen)
    y = torch.randint(0, V, (N,), generator=gen)
    y[torch.randperm(N, generator=gen)[:n_ignored]] = ignore
    return z, y


def _grad(fn, z, y, dtype, reduction, w=None):
    zz = z.detach().to(dtype, copy=True).requires_grad_(True)
    out = fn(zz, y, reduction)
    (out if reduction != "none" else (out * w.to(out.dtype)).sum()).backward()
    return out, zz.grad


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("N,V,n_ignored", [(1, 5, 0), (37, 100, 5), (16, 4096, 3), (9, 33, 0)])
def test_loss_and_gradient_match_the_float64_definition(reduction, N, V, n_ignored, path, autograd_nodes):
    z, y = _case(N, V, seed=N + V, n_ignored=n_ignored)
    w = torch.randn(N, generator=torch.Generator().manual_seed(1))
    out, g = _grad(lambda a, b, r: cross_entropy(a, b, -100, r), z, y, torch.float32, reduction, w)
    assert out.dtype == torch.float32
    assert any("cross_entropy" in n for n in autograd_nodes(out)) == (path == "c"), autograd_nodes(out)
    ref, rg = _grad(lambda a, b, r: ref64(a, b, -100, r), z, y, torch.float64, reduction, w)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    assert (g.double() - rg).abs().max() <= 1e-5 * rg.abs().max()
    if n_ignored:
        assert torch.equal(g[y == -100], torch.zeros_like(g[y == -100]))


def test_extreme_logits_stay_finite():
    z = torch.tensor([[1e30, -1e30, 0.0], [-80.0, -90.0, -100.0], [88.0, 87.0, 0.0]])
    y = torch.tensor([0, 2, 1])
    out, g = _grad(lambda a, b, r: cross_entropy(a, b, -100, r), z, y, torch.float32, "none", torch.ones(3))
    ref = rows64(z, y, -100)
    assert torch.isfinite(out).all() and torch.isfinite(g).all()
    torch.testing.assert_close(out.double(), ref, atol=1e-4, rtol=1e-5)


def test_all_rows_ignored_gives_nan_mean_like_torch():
    z, y = _case(4, 7, seed=2)
    y[:] = -100
    assert math.isnan(float(cross_entropy(z, y))) and math.isnan(float(torch.nn.functional.cross_entropy(z, y)))


def test_c_op_does_not_depend_on_threads_or_other_rows(at_1_and_2_threads):
    z, y = _case(64, 1000, seed=7, n_ignored=4)
    fn = lambda: _grad(lambda a, b, r: cross_entropy(a, b, -100, r), z, y, torch.float32, "none",  # noqa: E731
                       torch.linspace(-1, 1, 64))
    one, two = at_1_and_2_threads(fn)
    assert torch.equal(one[0], two[0]) and torch.equal(one[1], two[1])
    alone = _grad(lambda a, b, r: cross_entropy(a, b, -100, r), z[10:13], y[10:13], torch.float32, "none",
                  torch.linspace(-1, 1, 64)[10:13])
    assert torch.equal(alone[0], one[0][10:13]) and torch.equal(alone[1], one[1][10:13])


def test_bad_targets_and_inputs_are_refused():
    z, y = _case(5, 10, seed=3)
    assert cross_entropy(z, y).ndim == 0                                          # control
    for bad in (10, -1):
        yb = y.clone()
        yb[3] = bad
        with pytest.raises(IndexError, match=rf"target {bad} at row 3 is outside the vocabulary \[0, 10\)"):
            cross_entropy(z, yb)
    with pytest.raises(ValueError, match=r"logits must be \[N, V\] and target \[N\]"):
        cross_entropy(z, y[:4])
    with pytest.raises(ValueError, match="reduction"):
        cross_entropy(z, y, reduction="avg")
    with pytest.raises(ValueError, match=r"k3::cross_entropy: logits: expected a contiguous fp32"):
        loss_mod._ce_op(z.t(), y, -100)
    with pytest.raises(ValueError, match=r"k3::cross_entropy: target: expected a contiguous int64"):
        loss_mod._ce_op(z, y.int(), -100)
    _, lse = loss_mod._ce_op(z, y, -100)
    with pytest.raises(ValueError, match=r"k3::cross_entropy_backward: dloss"):
        loss_mod._ce_bwd_op(z, y, lse, torch.ones(4), -100)


def test_bf16_logits_are_computed_in_fp32():
    z, y = _case(6, 50, seed=4)
    out = cross_entropy(z.bfloat16(), y)
    torch.testing.assert_close(out.double(), ref64(z.bfloat16().float(), y, -100, "mean"), atol=1e-5, rtol=1e-5)


def test_traces_through_make_fx():
    from torch.fx.experimental.proxy_tensor import make_fx
    z, y = _case(4, 9, seed=5)
    gm = make_fx(lambda a, b: cross_entropy(a, b))(z, y)
    assert any("cross_entropy" in str(n.target) for n in gm.graph.nodes)
    torch.testing.assert_close(gm(z, y), cross_entropy(z, y))
