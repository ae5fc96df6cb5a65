"""Whole-model init: meta build -> to_empty -> init_weights() draws what eager construction draws.

Every parameter and buffer is checked. Tensors of the same kind (the name without its layer
index) are pooled over layers, then compared with an eagerly built model: constants exactly, random
tensors by mean and std within 6 standard errors of the two sample sizes, and known supports
(A_log = log U(1, 16), dt_bias = softplus⁻¹ of [1e-3, 1e-1], convs U(±1/sqrt(K))) exactly.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections import defaultdict

import pytest
import torch

from k3.config import get_preset
from k3.errors import K3Error
from k3.model.decoder import K3ForCausalLM


def _kimi_linear_mode():
    c = get_preset("nano")
    lac = dataclasses.replace(c.linear_attn_config, gate_lower_bound=None, use_full_rank_gate=False)
    return c.replace(q_lora_rank=None, attn_res_block_size=None, routed_expert_hidden_size=None,
                     latent_moe_use_norm=False, mla_use_output_gate=False, first_k_dense_replace=1,
                     tie_word_embeddings=True, linear_attn_config=lac, hidden_act="silu",
                     activation_situ_linear_beta=None)


CONFIGS = {"nano": lambda: get_preset("nano"), "kimi-linear-mode": _kimi_linear_mode}


def _tensors(model) -> dict[str, torch.Tensor]:
    return {**dict(model.named_parameters()), **dict(model.named_buffers())}


def _pooled(model) -> dict[str, torch.Tensor]:
    """kind (name with layer indices replaced by *) -> all its values, flattened, fp64."""
    pools = defaultdict(list)
    for name, t in _tensors(model).items():
        pools[re.sub(r"\.\d+\.", ".*.", name)].append(t.detach().double().reshape(-1))
    return {k: torch.cat(v) for k, v in pools.items()}


def _meta_then_init(cfg):
    with torch.device("meta"):
        model = K3ForCausalLM(cfg)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for t in _tensors(model).values():     # garbage a missed tensor would keep (fla's habit)
            t.fill_(float("nan"))
    return model.init_weights()


def _softplus_inv(y: float) -> float:
    return y + math.log(-math.expm1(-y))


@pytest.mark.parametrize("which", list(CONFIGS))
def test_init_weights_after_to_empty_matches_eager_distribution(which):
    cfg = CONFIGS[which]()
    torch.manual_seed(1)
    model = _meta_then_init(cfg)
    tied = model.lm_head.weight is model.model.embed_tokens.weight
    assert tied == cfg.tie_word_embeddings           # to_empty unties; init_weights ties again
    got = _pooled(model)
    torch.manual_seed(2)
    want = _pooled(K3ForCausalLM(cfg))
    assert set(got) == set(want)
    std = cfg.initializer_range
    K = cfg.linear_attn_config.short_conv_kernel_size
    for kind, a in got.items():
        b = want[kind]
        assert torch.isfinite(a).all(), f"{kind}: not initialised"
        if kind.endswith(("norm.weight", "layernorm.weight")):
            assert torch.equal(a, torch.ones_like(a)), kind
        elif kind.endswith(("_res_proj.weight", "e_score_correction_bias")):
            assert torch.equal(a, torch.zeros_like(a)), kind
        else:
            n1, n2 = a.numel(), b.numel()
            s = b.std().item()
            se = math.sqrt(1 / n1 + 1 / n2)
            assert abs(a.mean() - b.mean()) <= 6 * s * se, kind
            assert abs(a.std() - s) <= 6 * s * se, kind
            if kind.endswith("A_log"):
                assert a.min() >= 0 and a.max() <= math.log(16) + 1e-6, kind
            elif kind.endswith("dt_bias"):
                assert a.min() >= _softplus_inv(1e-3) - 1e-5 and a.max() <= _softplus_inv(1e-1) + 1e-5
            elif kind.endswith("_conv1d.weight"):
                assert a.abs().max() <= 1 / math.sqrt(K), kind
            else:                                  # every projection, embedding, expert: N(0, std)
                assert abs(s - std) <= 6 * std * math.sqrt(1 / n2), kind
                assert abs(a.std().item() - std) <= 6 * std * math.sqrt(1 / n1), kind


def test_init_weights_restores_a_trained_model_and_keeps_ties():
    cfg = _kimi_linear_mode()
    model = K3ForCausalLM(cfg)
    with torch.no_grad():
        for t in _tensors(model).values():
            t.add_(3.0)
    assert model.init_weights() is model
    assert model.lm_head.weight is model.model.embed_tokens.weight
    pools = _pooled(model)
    assert torch.equal(pools["model.norm.weight"], torch.ones(cfg.hidden_size, dtype=torch.float64))
    assert pools["model.embed_tokens.weight"].mean().abs() < 0.01     # was shifted by 3
    for t in model.moe_layers():
        assert torch.equal(t.gate.e_score_correction_bias, torch.zeros(cfg.num_experts))


def test_a_k3_module_with_tensors_but_no_reset_is_refused():
    from torch import nn

    class Extra(nn.Module):             # a k3-like module (module path under k3.) with no reset
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.zeros(3))
    Extra.__module__ = "k3.model.extra"
    model = K3ForCausalLM(get_preset("nano"))
    model.init_weights()                            # positive control: the real tree is complete
    model.model.extra = Extra()
    with pytest.raises(K3Error, match=r"model\.extra \(Extra\).*\['w'\].*reset_parameters"):
        model.init_weights()
