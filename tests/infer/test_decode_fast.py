"""The prepared-weights decode step (``k3.infer.decode_fast``) piece by piece against the model's
own modules (pre-norm + sublayer + residual, as ``model(...)`` runs them): every sublayer's output
within 1e-5 of its scale, the MoE with few and with many slots, the AttnRes row mix, the
Kimi-Linear geometry (SwiGLU, plain MoE, low-rank KDA gate without lower bound, ungated MLA), and
the plan rebuilt when a weight or the router bias changes."""

from __future__ import annotations

import copy

import pytest
import torch

from k3.config import get_preset
from k3.infer.decode_fast import DecodePlan, kda_step, mla_step, moe_step
from k3.infer.decode_prep import prepare_unsupported, weights_key
from k3.infer.decode_step import DecodeStep
from k3.model.decoder import K3ForCausalLM
from k3.ops.attn_res import attn_res_mix, attn_res_mix_rows
from k3.ops.decode_rows import attn_res_mix_c

from test_decode_step import _prefilled  # same folder (pytest puts it on sys.path)


def _close(got, want, tol=1e-5):
    scale = want.abs().max().clamp_min(1e-30)
    assert (got - want).abs().max() <= tol * scale, float((got - want).abs().max() / scale)


def _sharpen(m: K3ForCausalLM, seed: int) -> K3ForCausalLM:
    """Non-zero AttnRes queries and router biases (their init is 0), so no folding is trivially exact."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith("_res_proj.weight"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
            elif name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
        for moe in m.moe_layers():
            moe.gate.e_score_correction_bias.copy_(torch.randn(moe.num_experts, generator=g) * 0.05)
    return m.eval()


@pytest.fixture(scope="module")
def k3_model(model):
    return _sharpen(copy.deepcopy(model), 5)


def _kimi_linear_nano():
    """nano's sizes in Kimi-Linear mode (SwiGLU, plain MoE with routed scaling, no AttnRes,
    ungated MLA, low-rank KDA gate with no lower bound)."""
    c = get_preset("nano")
    lac = c.linear_attn_config
    return get_preset(
        "kimi-linear-48b", vocab_size=c.vocab_size, hidden_size=c.hidden_size, num_hidden_layers=c.num_hidden_layers,
        num_attention_heads=c.num_attention_heads, q_lora_rank=c.q_lora_rank, kv_lora_rank=c.kv_lora_rank,
        qk_nope_head_dim=c.qk_nope_head_dim, qk_rope_head_dim=c.qk_rope_head_dim, v_head_dim=c.v_head_dim,
        intermediate_size=c.intermediate_size, num_experts=c.num_experts, num_experts_per_token=c.num_experts_per_token,
        moe_intermediate_size=c.moe_intermediate_size, first_k_dense_replace=1, max_position_embeddings=2048,
        pad_token_id=0, bos_token_id=1, eos_token_id=2,
        linear_attn_config={"kda_layers": lac.kda_layers, "full_attn_layers": lac.full_attn_layers,
                            "num_heads": lac.num_heads, "head_dim": lac.head_dim, "short_conv_kernel_size": 4,
                            "gate_lower_bound": None, "use_full_rank_gate": False})


@pytest.fixture(scope="module")
def kimi_model():
    torch.manual_seed(1)
    m = K3ForCausalLM(_kimi_linear_nano())
    with torch.no_grad():
        m.lm_head.weight.mul_(20)
    return _sharpen(m, 6)


@pytest.fixture(scope="module")
def variant_model():
    """nano with the other branches: no q LoRA (q_proj absorbed directly), no latent norm,
    SiTU without its linear tanh, an ungated MLA."""
    torch.manual_seed(2)
    cfg = get_preset("nano", q_lora_rank=None, latent_moe_use_norm=False, activation_situ_linear_beta=None,
                     mla_use_output_gate=False)
    m = K3ForCausalLM(cfg)
    with torch.no_grad():
        m.lm_head.weight.mul_(20)
    return _sharpen(m, 7)


@pytest.fixture(scope="module")
def odd_mla_model():
    """nano with MLA sizes off the C kernel's 16-float runs (latent 24, rope 8: its scalar tails) and 5
    heads (head blocks of 4 and 1)."""
    torch.manual_seed(3)
    m = K3ForCausalLM(get_preset("nano", kv_lora_rank=24, qk_rope_head_dim=8, num_attention_heads=5))
    with torch.no_grad():
        m.lm_head.weight.mul_(20)
    return _sharpen(m, 8)


def _rows(B, H, seed):
    return torch.randn(B, H, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", ["k3_model", "kimi_model", "variant_model", "odd_mla_model"])
@torch.no_grad()
def test_each_sublayer_equals_its_module(request, name):
    model = request.getfixturevalue(name)
    assert prepare_unsupported(model) is None
    plan = DecodePlan(model)
    cfg = model.config
    B, H = 3, cfg.hidden_size
    g = torch.Generator().manual_seed(0)
    for i, (layer, L) in enumerate(zip(model.model.layers, plan.layers)):
        x, res = _rows(B, H, 10 + i), _rows(B, H, 20 + i)
        a = layer.self_attn
        if layer.is_kda:
            conv = torch.randn(B, 3 * a.num_heads * a.head_dim, a.conv_kernel_size - 1, generator=g)
            S = torch.randn(B, a.num_heads, a.head_dim, a.head_dim, generator=g) * 0.1
            want, wconv, wS = a.decode_math(layer.input_layernorm(x), conv, S.clone())
            got, gconv, gS = kda_step(L.attn, x, res, conv, S.clone())
            _close(gconv, wconv), _close(gS, wS)
        else:
            n = 7
            c = torch.randn(B, n, a.kv_lora_rank, generator=g)
            pe = torch.randn(B, n, a.qk_rope_head_dim, generator=g)
            lengths = torch.tensor([7, 4, 1][:B])
            c[1, 4:], pe[1, 4:], c[2, 1:], pe[2, 1:] = 0, 0, 0, 0     # padding past each row's length
            want, wc, wpe = a.decode_math(layer.input_layernorm(x), c, pe, lengths)
            got, gc, gpe = mla_step(L.attn, x, res, c, pe, lengths)
            _close(gc, wc), _close(gpe, wpe)
        _close(got, res + want)
        ffn = layer.ffn
        want = res + ffn(layer.post_attention_layernorm(x))
        _close(L.ffn_step(L.ffn, x, res), want)


@pytest.mark.parametrize("N", [1, 2, 3, 16])
@torch.no_grad()
def test_moe_step_equals_the_module(k3_model, N):
    """Few slots (N·k < E, some experts untouched) and many (every expert, several slots each)."""
    model = k3_model
    plan = DecodePlan(model)
    layer = next(l for l in model.model.layers if hasattr(l, "block_sparse_moe"))
    L = plan.layers[layer.layer_idx]
    moe = layer.block_sparse_moe
    assert (N * moe.top_k < moe.num_experts) == (N < 4)   # nano: 8 experts, top 2
    x, res = _rows(N, model.config.hidden_size, N), _rows(N, model.config.hidden_size, 99)
    want = res + moe(layer.post_attention_layernorm(x))
    _close(moe_step(L.ffn, x, res), want)


@torch.no_grad()
def test_attn_res_rows_mix_equals_the_training_mix(k3_model):
    plan = DecodePlan(k3_model)
    layer = k3_model.model.layers[1]
    q, c = plan.layers[1].mix_attn
    for n in (1, 2, 4):
        srcs = [_rows(3, 64, 40 + i) * (i + 1) for i in range(n)]
        want = attn_res_mix(srcs, layer.self_attention_res_proj.weight, layer.self_attention_res_norm.weight,
                            layer.self_attention_res_norm.eps)
        _close(attn_res_mix_c(q, c, srcs), want)
        _close(attn_res_mix_rows(srcs, layer.self_attention_res_proj.weight, layer.self_attention_res_norm.weight,
                                 layer.self_attention_res_norm.eps), want)


@pytest.mark.parametrize("name", ["k3_model", "kimi_model", "variant_model"])
@pytest.mark.parametrize("lengths", [[9], [3, 17, 8, 30, 5]])
@torch.no_grad()
def test_prepared_step_matches_the_model_forward(request, name, lengths):
    model = request.getfixturevalue(name)
    ref, mine = _prefilled(model, lengths, 0), _prefilled(model, lengths, 0)
    step = DecodeStep(model)
    tok = torch.randint(0, model.config.vocab_size, (len(lengths),), generator=torch.Generator().manual_seed(1))
    for _ in range(5):
        want = model(tok[:, None], cache=ref, logits_to_keep=1).logits[:, -1]
        got = step.step(tok, mine)
        assert step._plan is not None            # the prepared path ran
        _close(got, want)
        assert torch.equal(got.argmax(-1), want.argmax(-1))
        tok = want.argmax(-1)


@torch.no_grad()
def test_the_plan_follows_weight_and_bias_updates(k3_model):
    model = copy.deepcopy(k3_model)
    step = DecodeStep(model)
    plan = step.plan()
    assert step.plan() is plan                      # unchanged weights: the same preparation
    moe = model.moe_layers()[0]
    moe.gate.e_score_correction_bias.add_(1.0)      # a router-bias update (QB) in place
    assert step.plan() is not plan
    plan = step.plan()
    key = weights_key(model)
    moe.gate.e_score_correction_bias.add_(1.0)
    assert weights_key(model) != key and step.plan() is not plan
    plan = step.plan()
    model.lm_head.weight.mul_(2)
    assert step.plan() is not plan
    plan = step.plan()
    moe.experts = copy.deepcopy(moe.experts)        # a replaced submodule (same values, new tensors)
    assert step.plan() is not plan
    c1, c2 = _prefilled(model, [6], 3), _prefilled(model, [6], 3)
    tok = torch.tensor([5])
    _close(step.step(tok, c1), model(tok[:, None], cache=c2, logits_to_keep=1).logits[:, -1])


def test_what_the_prepared_step_refuses_falls_back(k3_model):
    model = copy.deepcopy(k3_model)
    assert prepare_unsupported(model) is None       # control
    for moe in model.moe_layers():   # group-limited routing (2 groups of 4, the best group kept)
        moe.gate.num_groups, moe.gate.topk_group = 2, 1
    assert "group-limited" in prepare_unsupported(model)
    step = DecodeStep(model)
    c1, c2 = _prefilled(model, [6], 3), _prefilled(model, [6], 3)
    tok = torch.tensor([5])
    with torch.no_grad():
        got = step.step(tok, c1)
        want = model(tok[:, None], cache=c2, logits_to_keep=1).logits[:, -1]
    assert step._plan is None
    _close(got, want)


def test_the_prepared_step_refuses_other_devices_and_oversized_models(k3_model):
    assert prepare_unsupported(k3_model) is None                                   # control
    size = sum(p.numel() * 4 for p in k3_model.parameters())
    assert prepare_unsupported(k3_model, max_bytes=size) is None
    assert "more than" in prepare_unsupported(k3_model, max_bytes=size - 1)
    assert "not on the CPU" in prepare_unsupported(copy.deepcopy(k3_model).to("meta"))


@pytest.mark.parametrize("preset", ["nano", "tiny"])   # head_dim 32 and 64: one column group and two
@torch.no_grad()
def test_kda_step_in_place_writes_the_same_state_over_its_input(preset):
    """``in_place``: the new state is written over S (the same tensor comes back) with the bits of the
    fresh-buffer step; the control: without it, S keeps its values."""
    torch.manual_seed(5)
    model = K3ForCausalLM(get_preset(preset)).eval()
    plan = DecodePlan(model)
    layer = next(l for l in model.model.layers if l.is_kda)
    L, a = plan.layers[layer.layer_idx], layer.self_attn
    B = 5
    g = torch.Generator().manual_seed(1)
    x, res = _rows(B, model.config.hidden_size, 30), _rows(B, model.config.hidden_size, 31)
    conv = torch.randn(B, 3 * a.num_heads * a.head_dim, a.conv_kernel_size - 1, generator=g)
    S = torch.randn(B, a.num_heads, a.head_dim, a.head_dim, generator=g) * 0.1
    S0 = S.clone()
    want, wconv, wS = kda_step(L.attn, x, res, conv, S)
    assert torch.equal(S, S0) and not torch.equal(wS, S0)          # fresh buffer: S untouched
    got, gconv, gS = kda_step(L.attn, x, res, conv, S, in_place=True)
    assert gS is S and torch.equal(S, wS)                          # in place: S is the new state
    assert torch.equal(got, want) and torch.equal(gconv, wconv)
