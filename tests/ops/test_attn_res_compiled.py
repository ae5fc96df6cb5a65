"""The opt-in compiled AttnRes mixing against the SPEC §3.3 formula in float64 (outputs and gradients)."""

from __future__ import annotations

import pytest
import torch

from k3.ops.attn_res import attn_res_mix, compiled_attn_res_mix


def formula(sources, query, gamma, eps=1e-5):
    """key_i = γ ⊙ v_i / rms(v_i); α = softmax_i <w, key_i>; out = Σ α_i v_i, all in float64."""
    v = torch.stack([s.double() for s in sources])
    key = gamma.double() * v / torch.sqrt(v.pow(2).mean(-1, keepdim=True) + eps)
    alpha = torch.softmax(key @ query.double(), dim=0)
    return (alpha.unsqueeze(-1) * v).sum(0)


@pytest.mark.slow
@pytest.mark.parametrize("mix", [attn_res_mix, compiled_attn_res_mix], ids=["eager", "compiled"])
def test_mixing_matches_the_float64_formula_with_gradients(mix):
    gen = torch.Generator().manual_seed(0)
    H = 32
    query, gamma = torch.randn(H, generator=gen), 1 + 0.1 * torch.randn(H, generator=gen)
    srcs = [torch.randn(2, 5, H, generator=gen).requires_grad_(True) for _ in range(3)]
    srcs64 = [s.detach().double().requires_grad_(True) for s in srcs]
    q64, g64 = query.double().requires_grad_(True), gamma.double().requires_grad_(True)
    query.requires_grad_(True), gamma.requires_grad_(True)
    w = torch.randn(2, 5, H, generator=gen)
    out = mix(srcs, query, gamma, 1e-5)
    (out * w).sum().backward()
    ref = formula(srcs64, q64, g64)
    (ref * w.double()).sum().backward()
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    for a, b in zip([*srcs, query, gamma], [*srcs64, q64, g64]):
        torch.testing.assert_close(a.grad.double(), b.grad, atol=1e-5, rtol=1e-5)
