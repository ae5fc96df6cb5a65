"""ops/norm.py: RMSNorm and the L2 norm against naive per-row formulas; one copy in the package."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

import k3
from k3.model.norm import RMSNorm
from k3.ops.attn_res import attn_res_mix
from k3.ops.norm import l2_normalize, rms_norm


def _naive_rms(row: list[float], w: list[float], eps: float) -> list[float]:
    r = math.sqrt(sum(x * x for x in row) / len(row) + eps)
    return [wi * x / r for wi, x in zip(w, row)]


def _naive_l2(row: list[float], eps: float) -> list[float]:
    n = math.sqrt(sum(x * x for x in row) + eps)
    return [x / n for x in row]


def test_rms_norm_matches_the_formula_row_by_row():
    x, w = torch.randn(3, 5, 12), torch.randn(12)
    got = rms_norm(x, w, 1e-5)
    want = torch.tensor([[_naive_rms(r, w.tolist(), 1e-5) for r in b] for b in x.tolist()])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_rms_norm_module_uses_the_op_and_keeps_dtype():
    norm = RMSNorm(8, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(0.5, 2, 8))
    x = torch.randn(4, 8, dtype=torch.bfloat16)
    out = norm(x)
    assert out.dtype == torch.bfloat16
    want = torch.tensor([_naive_rms(r, norm.weight.tolist(), 1e-6) for r in x.float().tolist()])
    torch.testing.assert_close(out.float(), want, rtol=1e-2, atol=1e-2)   # bf16 output rounding


def test_l2_normalize_matches_the_formula():
    x = torch.randn(6, 16, dtype=torch.float64)
    want = torch.tensor([_naive_l2(r, 1e-6) for r in x.tolist()], dtype=torch.float64)
    torch.testing.assert_close(l2_normalize(x).double(), want, rtol=1e-6, atol=1e-7)
    assert torch.all(l2_normalize(torch.zeros(2, 4)) == 0)


def test_attn_res_keys_are_rms_normed_with_the_key_weight():
    # Two sources: α = softmax(<w, RMSNorm(v_i; γ)>) computed here from the naive formula.
    v0, v1, w, gamma = torch.randn(7), torch.randn(7), torch.randn(7), torch.rand(7) + 0.5
    k0, k1 = (_naive_rms(v.tolist(), gamma.tolist(), 1e-5) for v in (v0, v1))
    l0, l1 = (sum(a * b for a, b in zip(w.tolist(), k)) for k in (k0, k1))
    a0 = math.exp(l0) / (math.exp(l0) + math.exp(l1))
    want = a0 * v0 + (1 - a0) * v1
    torch.testing.assert_close(attn_res_mix([v0, v1], w, gamma, 1e-5), want, rtol=1e-5, atol=1e-6)


def test_one_normalization_implementation_in_the_package():
    # rsqrt of a mean/sum of squares is written once, in ops/norm.py; everything else calls it.
    src = Path(k3.__file__).parent
    users = sorted(str(p.relative_to(src)) for p in src.rglob("*.py") if "rsqrt" in p.read_text())
    assert users == ["ops/norm.py"]


@pytest.mark.parametrize("eps", [1e-5, 1e-6])
def test_rms_norm_gradient_matches_the_formula(eps):
    x = torch.randn(4, 9, dtype=torch.float64, requires_grad=True)
    w = torch.randn(9, dtype=torch.float64, requires_grad=True)
    ref = lambda x, w: w * x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)  # noqa: E731
    g1 = torch.autograd.grad(rms_norm(x, w, eps).sum(), (x, w))
    g2 = torch.autograd.grad(ref(x, w).sum(), (x, w))
    for a, b in zip(g1, g2):                   # the op computes in fp32
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_attn_res_mix_is_fp32_under_bf16_autocast():
    srcs = [torch.randn(3, 16) for _ in range(3)]
    w, gamma = torch.randn(16), torch.rand(16) + 0.5
    want = attn_res_mix(srcs, w, gamma)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = attn_res_mix(srcs, w, gamma)
        assert (srcs[0] @ w).dtype == torch.bfloat16      # positive control
    assert got.dtype == torch.float32 and torch.equal(got, want)
