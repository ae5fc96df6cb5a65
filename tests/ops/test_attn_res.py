"""Block AttnRes mixing (SPEC §3.3): the C op (``k3::attn_res_mix``, forward and backward) and the torch
formulation, each against the formula in float64, outputs and gradients."""

from __future__ import annotations

import pytest
import torch

from k3.ops import attn_res
from k3.ops.attn_res import attn_res_mix


def formula(sources, query, gamma, eps=1e-5):
    """key_i = γ ⊙ v_i / rms(v_i); α = softmax_i <w, key_i>; out = Σ α_i v_i, all in float64."""
    v = torch.stack([s.double() for s in sources])
    key = gamma.double() * v / torch.sqrt(v.pow(2).mean(-1, keepdim=True) + eps)
    alpha = torch.softmax(key @ query.double().reshape(-1), dim=0)
    return (alpha.unsqueeze(-1) * v).sum(0)


def _inputs(n, shape, H, seed=0, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    srcs = [scale * (i + 1) * torch.randn(*shape, H, generator=gen) for i in range(n)]
    query, gamma = torch.randn(H, generator=gen), 1 + 0.1 * torch.randn(H, generator=gen)
    dout = torch.randn(*shape, H, generator=gen)
    return srcs, query, gamma, dout


def _run(mix, srcs, query, gamma, dout, dtype=torch.float32):
    xs = [s.detach().to(dtype, copy=True).requires_grad_(True) for s in srcs]
    q, g = (t.detach().to(dtype, copy=True).requires_grad_(True) for t in (query, gamma))
    out = mix(xs, q, g, 1e-5)
    (out.double() * dout.double()).sum().backward()
    return out, [x.grad for x in (*xs, q, g)]


@pytest.mark.parametrize("n,shape", [(2, (3, 7)), (5, (2, 70)), (9, (130,))])
def test_mix_and_its_gradients_match_the_float64_formula(n, shape, path):
    # 130 and 140 rows: the backward's per-64-row blocks of dq sums with a partial last block.
    srcs, query, gamma, dout = _inputs(n, shape, 48, seed=n)
    out, grads = _run(attn_res_mix, srcs, query, gamma, dout)
    ran_c = "attn_res_mix" in type(out.grad_fn).__name__
    assert ran_c == (path == "c"), out.grad_fn
    ref, want = _run(formula, srcs, query, gamma, dout, torch.float64)
    assert out.dtype == torch.float32 and out.shape == srcs[0].shape
    # Each output is a sum of n terms α_i v_i rounded in fp32: to fp32 rounding of the largest entry
    # (an entry near 0 can sit beside terms of size 30; AVX2's torch kernels left 1.06e-5 there, at n = 9).
    assert (out.double() - ref).abs().max() <= 1e-5 * ref.abs().max()
    for i, (a, b) in enumerate(zip(grads, want)):   # to fp32 rounding of the largest entry (dq sums rows)
        assert (a.double() - b).abs().max() <= 1e-5 * b.abs().max(), f"gradient {i}"


def test_c_mix_does_not_depend_on_threads_or_other_rows(at_1_and_2_threads):
    srcs, query, gamma, dout = _inputs(4, (3, 50), 64, seed=1)
    one, two = at_1_and_2_threads(lambda: _run(attn_res_mix, srcs, query, gamma, dout))
    assert torch.equal(one[0], two[0]) and all(torch.equal(a, b) for a, b in zip(one[1], two[1]))
    # A row's output and its sources' gradients come out the same beside other rows or alone.
    part = _run(attn_res_mix, [s[1:2, 10:30] for s in srcs], query, gamma, dout[1:2, 10:30])
    assert torch.equal(part[0], one[0][1:2, 10:30])
    assert all(torch.equal(a, b[1:2, 10:30]) for a, b in zip(part[1][:4], one[1][:4]))
    # Control: the torch formulation rounds differently, within fp32 of the C op.
    ref = _run(attn_res._mix_torch, srcs, query, gamma, dout)
    assert not torch.equal(ref[0], one[0])
    torch.testing.assert_close(ref[0], one[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("case", ["bf16", "65 sources", "query [1, H]"])
def test_inputs_the_c_op_does_not_take_use_the_torch_formulation(case):
    n = 65 if case == "65 sources" else 3
    dtype = torch.bfloat16 if case == "bf16" else torch.float32
    srcs, query, gamma, dout = _inputs(n, (2, 5), 32, seed=2)
    if case == "query [1, H]":
        query = query[None]
    srcs, query, gamma = ([t.to(dtype) for t in srcs], query.to(dtype), gamma.to(dtype))   # what the mix sees
    out, grads = _run(attn_res_mix, srcs, query, gamma, dout, dtype)
    assert ("attn_res_mix" in type(out.grad_fn).__name__) == (case == "query [1, H]")
    ref, want = _run(formula, srcs, query, gamma, dout, torch.float64)
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    assert out.dtype == dtype
    assert (out.double() - ref).abs().max() <= tol * ref.abs().max()
    assert (grads[0].double() - want[0]).abs().max() <= tol * want[0].abs().max()


def test_c_op_traces_with_fake_tensors():
    # The op has a fake (shape-only) implementation, so tracing and torch.compile see through it.
    from torch.fx.experimental.proxy_tensor import make_fx
    srcs, query, gamma, _ = _inputs(3, (2, 6), 16, seed=3)
    gm = make_fx(lambda a, b, c, q, g: attn_res_mix([a, b, c], q, g), tracing_mode="fake")(*srcs, query, gamma)
    assert any("attn_res_mix" in str(n.target) for n in gm.graph.nodes)
    torch.testing.assert_close(gm(*srcs, query, gamma).double(), formula(srcs, query, gamma), atol=1e-5, rtol=1e-5)
