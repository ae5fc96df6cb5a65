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


@pytest.mark.slow
def test_model_opt_in_uses_the_compiled_mix_and_keeps_the_logits():
    import k3.ops.attn_res as attn_res
    from k3.config import get_preset
    from k3.model.decoder import K3ForCausalLM

    torch.manual_seed(0)
    eager = K3ForCausalLM(get_preset("nano")).eval()
    compiled = K3ForCausalLM(get_preset("nano")).eval()
    compiled.load_state_dict(eager.state_dict())
    for m in (eager, compiled):   # non-zero pseudo-queries, so the mix is not uniform
        for name, p in m.named_parameters():
            if name.endswith("_res_proj.weight"):
                with torch.no_grad():
                    p.copy_(torch.linspace(-1, 1, p.numel()).view_as(p))
    compiled.compile_attn_res()
    ids = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = eager(ids).logits
        attn_res._COMPILED = None
        got = compiled(ids).logits
    assert attn_res._COMPILED is not None          # the compiled path ran
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert not getattr(eager.model.layers[0], "attn_res_compiled", False)   # per model, not global


def test_opt_in_is_refused_without_attn_res_and_accepted_with_it():
    from k3.config import get_preset
    from k3.model.decoder import K3ForCausalLM
    from k3.errors import ConfigError
    from k3.train.config import TrainConfig, resolve_model_config

    with pytest.raises(ValueError, match="attn_res_block_size"):
        K3ForCausalLM(get_preset("nano", attn_res_block_size=None)).compile_attn_res()
    assert K3ForCausalLM(get_preset("nano")).compile_attn_res().model.layers[0].attn_res_compiled
    tc = TrainConfig.build(overrides={"preset": "nano", "compile_attn_res": True})
    assert resolve_model_config(tc).attn_res_block_size is not None
    with pytest.raises(ConfigError, match="compile_attn_res=true needs Block AttnRes"):
        resolve_model_config(tc.replace(attn_res=False))
    with pytest.raises(Exception, match="compile_attn_res"):
        TrainConfig.build(overrides={"preset": "nano", "compile_attn_res": "yes"})
