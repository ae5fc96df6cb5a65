"""The prepared-weights decode backend (``k3.infer.prepared``) against the model's own modules.

One forward: ``model(tokens, cache, prepared=P)`` runs the same layers as ``model(tokens, cache)``
with each sublayer's math in its prepared form. Checked piece by piece (every sublayer, with the
cache entry it writes, the MoE with few and with many slots, the AttnRes mix against its float64
formula) and whole (logits within 1e-5 of their scale, the same argmax and caches, step after
step, at batch 1 and at a batch of mixed lengths), on the K3 geometry, the Kimi-Linear geometry
(SwiGLU, plain MoE, low-rank KDA gate without lower bound, ungated MLA), the other branches and odd
MLA sizes; the engine's greedy tokens the same with the backend on and off; what it refuses is
named, and the engine then runs the modules."""

from __future__ import annotations

import copy

import pytest
import torch

from engine_reference import reference_greedy
from k3.config import get_preset
from k3.errors import K3Error
from k3.infer.engine import Engine
from k3.infer.prepared import PreparedModel, PreparedWeights, accepts, prepare_unsupported, weights_key
from k3.infer.sampling import SamplingParams
from k3.model.cache import K3Cache, KDAState, MLAState
from k3.model.decoder import K3ForCausalLM
from k3.model.stats import ForwardStats
from k3.ops.decode_layers import kda_layer_step
from k3.ops.decode_rows import attn_res_mix_c

pytestmark = pytest.mark.usefixtures("no_engine_thread_left")


def _close(got, want, tol=1e-5):
    scale = want.abs().max().clamp_min(1e-30)
    assert (got - want).abs().max() <= tol * scale, float((got - want).abs().max() / scale)


def _sharpen(m: K3ForCausalLM, seed: int) -> K3ForCausalLM:
    """Non-zero AttnRes queries and router biases, norms off 1 (their inits would make folding
    trivially exact)."""
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


def _built(cfg, seed: int) -> K3ForCausalLM:
    torch.manual_seed(seed)
    m = K3ForCausalLM(cfg)
    with torch.no_grad():
        m.lm_head.weight.mul_(20)
    return _sharpen(m, seed + 5)


@pytest.fixture(scope="module")
def kimi_model():
    return _built(_kimi_linear_nano(), 1)


@pytest.fixture(scope="module")
def variant_model():
    """nano with the other branches: no q LoRA (q_proj absorbed directly), no latent norm, SiTU
    without its linear tanh, an ungated MLA."""
    return _built(get_preset("nano", q_lora_rank=None, latent_moe_use_norm=False,
                             activation_situ_linear_beta=None, mla_use_output_gate=False), 2)


@pytest.fixture(scope="module")
def odd_mla_model():
    """MLA sizes off the C kernel's 16-float runs (latent 24, rope 8: its scalar tails), 5 heads."""
    return _built(get_preset("nano", kv_lora_rank=24, qk_rope_head_dim=8, num_attention_heads=5), 3)


MODELS = ["k3_model", "kimi_model", "variant_model", "odd_mla_model"]


def _rows(B, H, seed):
    """[B, H] rows: the stream as the prepared backend takes it (one token per row)."""
    return torch.randn(B, H, generator=torch.Generator().manual_seed(seed))


def _prefilled(model, lengths: list[int], seed: int) -> K3Cache:
    g = torch.Generator().manual_seed(seed)
    caches = []
    with torch.no_grad():
        for n in lengths:
            c = model.new_cache(1)
            model(torch.randint(0, model.config.vocab_size, (1, n), generator=g), cache=c)
            caches.append(c)
    return K3Cache.cat(caches)


def _same_state(a: K3Cache, b: K3Cache) -> None:
    assert torch.equal(a.seq_lens, b.seq_lens)
    for x, y in zip(a.layers, b.layers):
        if isinstance(x, KDAState):
            _close(x.conv, y.conv), _close(x.recurrent, y.recurrent)
        else:
            assert torch.equal(x.lengths, y.lengths)
            _close(x.c, y.c), _close(x.k_pe, y.k_pe)


def _layer_state(a, B: int, g):
    """A written cache entry for attention module ``a``: random KDA conv/state, or MLA latents of
    3 rows of lengths 7, 4, 1 (padding past each row's length)."""
    if hasattr(a, "conv_kernel_size"):
        s = KDAState(B, a.num_heads, a.head_dim, a.conv_kernel_size)
        s.conv = torch.randn(B, 3 * a.num_heads * a.head_dim, a.conv_kernel_size - 1, generator=g)
        s.recurrent = torch.randn(B, a.num_heads, a.head_dim, a.head_dim, generator=g) * 0.1
        return s
    rows = []
    for n in (7, 4, 1)[:B]:
        r = MLAState(1, a.kv_lora_rank, a.qk_rope_head_dim)
        r.append(torch.randn(1, n, a.kv_lora_rank, generator=g), torch.randn(1, n, a.qk_rope_head_dim, generator=g))
        rows.append(r)
    return MLAState.cat(rows)


def _copy(s):
    return s.clone()


@pytest.mark.parametrize("name", MODELS)
@torch.no_grad()
def test_each_sublayer_equals_its_modules_and_writes_the_same_cache_entry(request, name):
    model = request.getfixturevalue(name)
    assert prepare_unsupported(model) is None
    P = PreparedModel(model)
    B, H = 3, model.config.hidden_size
    g = torch.Generator().manual_seed(0)
    for i, (layer, L) in enumerate(zip(model.model.layers, P.layers)):
        h, res = _rows(B, H, 10 + i), _rows(B, H, 20 + i)
        st = _layer_state(layer.self_attn, B, g)
        want_st, got_st = _copy(st), _copy(st)
        want = res + layer.self_attn(layer.input_layernorm(h[:, None]), want_st)[:, 0]   # the module path
        _close(L.attn(h, res, got_st), want)
        _close(L.attn(h, None, _copy(st)), want - res)                            # no residual
        if isinstance(st, KDAState):
            _close(got_st.conv, want_st.conv), _close(got_st.recurrent, want_st.recurrent)
        else:
            assert torch.equal(got_st.lengths, want_st.lengths) and got_st.lengths.tolist() == [8, 5, 2]
            _close(got_st.c, want_st.c), _close(got_st.k_pe, want_st.k_pe)
        _close(L.ffn(h, res), res + layer.ffn(layer.post_attention_layernorm(h)))


@pytest.mark.parametrize("N", [1, 2, 3, 16])
@torch.no_grad()
def test_the_prepared_moe_equals_the_module_with_few_and_many_slots(k3_model, N):
    """Few slots (N·k < E, some experts untouched) and many (every expert, several slots each)."""
    P = PreparedModel(k3_model)
    layer = next(l for l in k3_model.model.layers if hasattr(l, "block_sparse_moe"))
    moe = layer.block_sparse_moe
    assert (N * moe.top_k < moe.num_experts) == (N < 4)   # nano: 8 experts, top 2
    h, res = _rows(N, k3_model.config.hidden_size, N), _rows(N, k3_model.config.hidden_size, 99)
    _close(P.layers[layer.layer_idx].ffn(h, res), res + moe(layer.post_attention_layernorm(h)))


@torch.no_grad()
def test_the_attn_res_mix_equals_its_float64_formula(k3_model):
    """The prepared mix (folded query, one C call) against the mix written out in float64 from the
    layer's own pseudo-query and key norm; a non-uniform mix (the control that the query acts)."""
    P = PreparedModel(k3_model)
    layer = k3_model.model.layers[1]
    w = layer.self_attention_res_proj.weight.double().reshape(-1)
    norm = layer.self_attention_res_norm
    gamma = norm.weight.double()
    for n in (1, 2, 5):
        srcs = [_rows(3, 64, 40 + i) * (i + 1) for i in range(n)]
        got = P.layers[1].mix("self_attention_res", srcs)
        v = torch.stack([s.double() for s in srcs])                                   # [n, B, H]
        keys = v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + norm.eps) * gamma
        alpha = torch.softmax(keys @ w, 0)                                            # [n, B]
        want = (alpha[..., None] * v).sum(0)
        _close(got.double(), want)
        if n == 5:
            assert not torch.allclose(alpha, torch.full_like(alpha, 1 / n), atol=1e-3)
    q, c = P.layers[1].folded["self_attention_res"]
    assert torch.equal(attn_res_mix_c(q, c, srcs), P.layers[1].mix("self_attention_res", srcs))


@pytest.mark.parametrize("name", ["k3_model", "kimi_model", "variant_model"])
@pytest.mark.parametrize("lengths", [[9], [3, 17, 8, 30, 5]])
@torch.no_grad()
def test_the_prepared_step_equals_the_module_step(request, name, lengths):
    model = request.getfixturevalue(name)
    ref, mine = _prefilled(model, lengths, 0), _prefilled(model, lengths, 0)
    weights = PreparedWeights(model)
    tok = torch.randint(0, model.config.vocab_size, (len(lengths), 1), generator=torch.Generator().manual_seed(1))
    for _ in range(5):
        want = model(tok, cache=ref, logits_to_keep=1).logits[:, -1]
        P = weights.current()
        assert P is not None, weights.why
        got = model(tok, cache=mine, logits_to_keep=1, prepared=P).logits[:, -1]
        _close(got, want)
        assert torch.equal(got.argmax(-1), want.argmax(-1))
        tok = want.argmax(-1)[:, None]
    _same_state(ref, mine)


def test_engine_greedy_tokens_same_with_the_prepared_backend_on_and_off(model):
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, model.config.vocab_size, (n,), generator=g).tolist() for n in (5, 12, 1, 33)]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    with Engine(model, max_batch=4) as on, Engine(model, max_batch=4, prepared_decode=False) as off:
        a = [o.token_ids for o in on.generate(prompts, params)]
        b = [o.token_ids for o in off.generate(prompts, params)]
        assert on.prepared._plan is not None and off.prepared is None    # the backend ran / did not
    assert a == b
    assert a == [reference_greedy(model, p, 12) for p in prompts]


@torch.no_grad()
def test_the_preparation_follows_weights_and_modules_and_refuses_statistics(k3_model):
    model = copy.deepcopy(k3_model)
    weights = PreparedWeights(model)
    P = weights.current()
    assert P is not None and weights.current() is P            # unchanged: the same preparation
    moe = model.moe_layers()[0]
    key = weights_key(model)
    moe.gate.e_score_correction_bias.add_(1.0)                  # a router-bias update (QB) in place
    assert weights_key(model) != key and weights.current() is not P
    P = weights.current()
    model.lm_head.weight.mul_(2)
    assert weights.current() is not P
    P = weights.current()
    moe.experts = copy.deepcopy(moe.experts)                    # a replaced submodule (same values)
    assert weights.current() is not P
    P = weights.current()
    assert P is not None and weights.why is None                # the control: unchanged, served
    c1, c2 = _prefilled(model, [6], 3), _prefilled(model, [6], 3)
    tok = torch.tensor([[5]])
    for stats in (ForwardStats(), ForwardStats(max_logits=True)):   # a trainer's statistics: refused, named
        with pytest.raises(ValueError, match="prepared weights measure no statistics"):
            model(tok, cache=c1, logits_to_keep=1, prepared=P, stats=stats)
    assert int(c1.seq_lens[0]) == int(c2.seq_lens[0])           # the refused step touched no cache
    _close(model(tok, cache=c1, logits_to_keep=1, prepared=P).logits,
           model(tok, cache=c2, logits_to_keep=1).logits)


def test_what_the_backend_refuses_is_named_and_the_engine_runs_the_modules(k3_model):
    model = copy.deepcopy(k3_model)
    assert prepare_unsupported(model) is None                   # control
    size = sum(p.numel() * 4 for p in model.parameters())
    assert prepare_unsupported(model, max_bytes=size) is None
    assert "more than" in prepare_unsupported(model, max_bytes=size - 1)
    assert "not on the CPU" in prepare_unsupported(copy.deepcopy(model).to("meta"))
    assert "not all fp32" in prepare_unsupported(copy.deepcopy(model).to(torch.bfloat16))
    for moe in model.moe_layers():   # group-limited routing (2 groups of 4, the best group kept)
        moe.gate.num_groups, moe.gate.topk_group = 2, 1
    assert "group-limited" in prepare_unsupported(model)
    prompt = [3, 1, 4, 1, 5]
    with Engine(model, max_batch=1) as eng:
        out = eng.generate([prompt], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
        assert eng.prepared.current() is None and "group-limited" in eng.prepared.why
    assert out[0].token_ids == reference_greedy(model, prompt, 6)


@torch.no_grad()
def test_prepared_weights_serve_a_decode_step_only(k3_model):
    P = PreparedModel(k3_model)
    cache = _prefilled(k3_model, [4, 6], 1)
    tok = torch.tensor([[3], [4]])
    with pytest.raises(ValueError, match="decode step only"):
        k3_model(tok, prepared=P)                                               # no cache
    with pytest.raises(ValueError, match="decode step only"):
        k3_model(torch.tensor([[3, 4], [5, 6]]), cache=cache.clone(), prepared=P)   # two tokens
    with torch.enable_grad(), pytest.raises(ValueError, match="decode step only"):
        k3_model(tok, cache=cache.clone(), prepared=P)                          # autograd on
    fresh = k3_model.new_cache(2)
    assert not accepts(fresh) and accepts(cache)
    with pytest.raises(K3Error, match="prefill the cache"):
        k3_model(tok, cache=fresh, prepared=P)
    assert k3_model(tok, cache=cache, prepared=P).logits.shape == (2, 1, k3_model.config.vocab_size)   # control


def test_a_cache_after_prepared_steps_continues_under_autograd(k3_model):
    """The backend's cache entries are ordinary tensors: a forward with autograd continues from
    them, with the no-grad forward's values."""
    model = copy.deepcopy(k3_model)
    cache = _prefilled(model, [5, 11], 2)
    P = PreparedModel(model)
    tok = torch.tensor([[3], [7]])
    with torch.no_grad():
        for _ in range(3):
            tok = model(tok, cache=cache, prepared=P).logits[:, -1].argmax(-1)[:, None]
        want = model(tok, cache=cache.clone(), logits_to_keep=1).logits       # control
    out = model(tok, cache=cache, logits_to_keep=1).logits
    out.sum().backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)
    # the autograd forward runs other kernels than the no-grad one: equal to fp32 rounding
    assert (out.detach() - want).abs().max() <= 1e-6 * max(1.0, want.abs().max().item())


@torch.no_grad()
def test_in_place_state_gives_the_same_step_and_only_it_overwrites_the_old_state(k3_model):
    """``in_place_state`` (the engine's setting) writes each KDA state over the cache's tensor: the
    logits and caches are bit-equal to the default's, step after step; a state tensor taken before
    a step keeps its values by default and is overwritten in place otherwise."""
    plain, inplace = _prefilled(k3_model, [5, 12, 7], 11), _prefilled(k3_model, [5, 12, 7], 11)
    preps = {False: PreparedModel(k3_model), True: PreparedModel(k3_model, in_place_state=True)}
    tok = torch.tensor([[3], [9], [27]])
    for _ in range(3):
        held = {k: [s.recurrent for s in c.layers if isinstance(s, KDAState)] for k, c in
                ((False, plain), (True, inplace))}
        before = {k: [t.clone() for t in v] for k, v in held.items()}
        a = k3_model(tok, cache=plain, prepared=preps[False]).logits
        b = k3_model(tok, cache=inplace, prepared=preps[True]).logits
        assert torch.equal(a, b)
        for x, y in zip(plain.layers, inplace.layers):
            if isinstance(x, KDAState):
                assert torch.equal(x.recurrent, y.recurrent) and torch.equal(x.conv, y.conv)
        new = [s.recurrent for s in inplace.layers if isinstance(s, KDAState)]
        for t, t0 in zip(held[False], before[False]):
            assert torch.equal(t, t0)                                   # the default leaves it alone
        for t, t0, n in zip(held[True], before[True], new):
            assert t is n and not torch.equal(t, t0)                    # in place: it is the new state
        tok = a[:, -1].argmax(-1)[:, None]


@pytest.mark.parametrize("preset", ["nano", "tiny"])   # head_dim 32 and 64: one column group and two
@torch.no_grad()
def test_the_kda_kernel_in_place_writes_the_fresh_buffers_bits(preset):
    torch.manual_seed(5)
    model = K3ForCausalLM(get_preset(preset)).eval()
    P = PreparedModel(model)
    layer = next(l for l in model.model.layers if l.is_kda)
    c, a = P.layers[layer.layer_idx].attn_w.c, layer.self_attn
    B, H = 5, model.config.hidden_size
    g = torch.Generator().manual_seed(1)
    x, res = _rows(B, H, 30), _rows(B, H, 31)
    conv = torch.randn(B, 3 * a.num_heads * a.head_dim, a.conv_kernel_size - 1, generator=g)
    S = torch.randn(B, a.num_heads, a.head_dim, a.head_dim, generator=g) * 0.1
    S0 = S.clone()
    want, wconv, wS = kda_layer_step(c, x, res, conv, S)
    assert torch.equal(S, S0) and not torch.equal(wS, S0)          # fresh buffer: S untouched
    got, gconv, gS = kda_layer_step(c, x, res, conv, S, in_place=True)
    assert gS is S and torch.equal(S, wS)                          # in place: S is the new state
    assert torch.equal(got, want) and torch.equal(gconv, wconv)
