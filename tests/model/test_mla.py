"""Gated MLA: naive ≡ absorbed ≡ an independent per-head dense reference; cache continuation ≡ one pass;
agreement with transformers' KimiLinearAttention (NoPE)."""

import math

import pytest
import torch

from k3.config import get_preset
from k3.model.cache import K3Cache, KDAState, MLAState
from k3.model.mla import GatedMLA


def _cfg(**kw):
    base = dict(num_attention_heads=3, kv_lora_rank=24, qk_nope_head_dim=12, qk_rope_head_dim=8, v_head_dim=10)
    base.update(kw)
    return get_preset("nano").replace(**base)


def _layer(seed=0, impl="auto", **kw):
    torch.manual_seed(seed)
    m = GatedMLA(_cfg(**kw), layer_idx=3, attn_impl=impl)
    with torch.no_grad():  # non-trivial norm weights so a missing norm would show
        for n, p in m.named_parameters():
            if "layernorm" in n:
                p.uniform_(0.5, 1.5)
    return m


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def dense_reference(m: GatedMLA, x: torch.Tensor) -> torch.Tensor:
    """Causal MLA written out head by head with explicit matmuls from the raw weights."""
    B, T, _ = x.shape
    nh, n, p, v, r = m.num_heads, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim, m.kv_lora_rank

    def rms(t, w, eps):
        return w * t / torch.sqrt(t.pow(2).mean(-1, keepdim=True) + eps)

    if m.q_lora_rank is None:
        q = x @ m.q_proj.weight.T
    else:
        q = rms(x @ m.q_a_proj.weight.T, m.q_a_layernorm.weight, m.q_a_layernorm.eps) @ m.q_b_proj.weight.T
    kv = x @ m.kv_a_proj_with_mqa.weight.T
    c = rms(kv[..., :r], m.kv_a_layernorm.weight, m.kv_a_layernorm.eps)
    k_pe = kv[..., r:]
    wkv = m.kv_b_proj.weight
    outs = []
    for h in range(nh):
        qh = q[..., h * (n + p):(h + 1) * (n + p)]
        rows = wkv[h * (n + v):(h + 1) * (n + v)]
        kh = torch.cat([c @ rows[:n].T, k_pe], -1)            # [B,T,n+p]
        vh = c @ rows[n:].T                                   # [B,T,v]
        s = qh @ kh.transpose(1, 2) / math.sqrt(n + p)
        s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
        outs.append(torch.softmax(s, -1) @ vh)
    o = torch.cat(outs, -1)
    if m.use_output_gate:
        o = o * torch.sigmoid(x @ m.g_proj.weight.T)
    return o @ m.o_proj.weight.T


@pytest.mark.parametrize("impl", ["naive", "absorb"])
@pytest.mark.parametrize("kw", [{}, {"q_lora_rank": None}, {"mla_use_output_gate": False}])
def test_both_paths_match_dense_per_head_reference(impl, kw):
    m = _layer(impl=impl, **kw)
    x = torch.randn(2, 9, m.hidden_size)
    with torch.no_grad():
        assert rel(m(x), dense_reference(m, x)) < 1e-5


def test_q_lora_none_and_gate_off_change_parameters():
    names = dict(_layer(q_lora_rank=None, mla_use_output_gate=False).named_parameters())
    assert "q_proj.weight" in names and "g_proj.weight" not in names and "q_a_proj.weight" not in names
    names = dict(_layer().named_parameters())
    assert {"q_a_proj.weight", "q_a_layernorm.weight", "q_b_proj.weight", "g_proj.weight"} <= set(names)


@pytest.mark.parametrize("impl", ["naive", "absorb", "auto"])
@pytest.mark.parametrize("kw", [{}, {"q_lora_rank": None, "mla_use_output_gate": False}])
def test_prefill_then_decode_matches_full_forward_fp32(impl, kw):
    m = _layer(seed=1, impl=impl, **kw)
    x = torch.randn(2, 13, m.hidden_size)
    with torch.no_grad():
        full = m(x)
        st = MLAState(2, m.kv_lora_rank, m.qk_rope_head_dim)
        pieces = [m(x[:, :5], st)]                  # prefill
        pieces.append(m(x[:, 5:9], st))             # chunked continuation on a non-empty cache
        pieces += [m(x[:, t:t + 1], st) for t in range(9, 13)]  # decode
    assert st.length == 13
    assert rel(torch.cat(pieces, 1), full) < 1e-5


def test_absorbed_decode_matches_naive_decode():
    m = _layer(seed=2)
    x = torch.randn(3, 20, m.hidden_size)
    outs = {}
    with torch.no_grad():
        for impl in ("naive", "absorb"):
            m.attn_impl = impl
            st = MLAState(3, m.kv_lora_rank, m.qk_rope_head_dim)
            m(x[:, :17], st)
            outs[impl] = torch.cat([m(x[:, t:t + 1], st) for t in range(17, 20)], 1)
    assert rel(outs["absorb"], outs["naive"]) < 1e-5


def test_cache_holds_normalized_latent_and_k_pe():
    m = _layer(seed=3)
    x = torch.randn(1, 4, m.hidden_size)
    st = MLAState(1, m.kv_lora_rank, m.qk_rope_head_dim)
    with torch.no_grad():
        m(x, st)
        kv = m.kv_a_proj_with_mqa(x)
        c = m.kv_a_layernorm(kv[..., :m.kv_lora_rank])
    torch.testing.assert_close(st.c, c)
    torch.testing.assert_close(st.k_pe, kv[..., m.kv_lora_rank:])


def test_gradients_match_between_paths():
    m = _layer(seed=4).double()
    x = torch.randn(2, 6, m.hidden_size, dtype=torch.float64)
    grads = {}
    for impl in ("naive", "absorb"):
        m.attn_impl = impl
        m.zero_grad()
        m(x).pow(2).sum().backward()
        grads[impl] = [p.grad.clone() for p in m.parameters()]
    for a, b in zip(grads["naive"], grads["absorb"]):
        assert rel(b, a) < 1e-6  # RMSNorm always computes in fp32


def test_bad_inputs_are_named():
    m = _layer()
    with pytest.raises(ValueError, match="hidden_size"):
        m(torch.randn(1, 3, m.hidden_size + 1))
    with pytest.raises(ValueError, match="hidden_size"):
        m(torch.randn(3, m.hidden_size))
    with pytest.raises(TypeError, match="MLAState"):
        m(torch.randn(1, 3, m.hidden_size), KDAState(1, 2, 4, 4))
    with pytest.raises(ValueError, match="batch_size=2"):
        m(torch.randn(1, 3, m.hidden_size), MLAState(2, m.kv_lora_rank, m.qk_rope_head_dim))
    with pytest.raises(ValueError, match="kv_lora_rank"):
        m(torch.randn(1, 3, m.hidden_size), MLAState(1, m.kv_lora_rank + 1, m.qk_rope_head_dim))
    with pytest.raises(ValueError, match="attn_impl"):
        m.attn_impl = "flash"


def test_works_with_a_k3cache_entry():
    cfg = _cfg()
    l = cfg.mla_layer_ids[0]
    torch.manual_seed(5)
    m = GatedMLA(cfg, l)
    cache = K3Cache(cfg, 2)
    x = torch.randn(2, 6, cfg.hidden_size)
    with torch.no_grad():
        y = torch.cat([m(x[:, :4], cache.layers[l]), m(x[:, 4:5], cache.layers[l]), m(x[:, 5:], cache.layers[l])], 1)
        assert rel(y, m(x)) < 1e-5


@pytest.mark.parametrize("q_lora", [None, 16])
def test_matches_transformers_kimi_linear_attention(q_lora):
    import transformers.models.kimi_linear.modeling_kimi_linear as tr
    from transformers import KimiLinearConfig

    m = _layer(seed=6, q_lora_rank=q_lora, mla_use_output_gate=False, mla_latent_norm_eps=1e-6)
    hf_cfg = KimiLinearConfig(hidden_size=m.hidden_size, num_attention_heads=m.num_heads,
                              num_key_value_heads=m.num_heads, q_lora_rank=q_lora, kv_lora_rank=m.kv_lora_rank,
                              qk_nope_head_dim=m.qk_nope_head_dim, qk_rope_head_dim=m.qk_rope_head_dim,
                              v_head_dim=m.v_head_dim, num_hidden_layers=4, vocab_size=32)
    hf_cfg._attn_implementation = "eager"
    ref = tr.KimiLinearAttention(hf_cfg, layer_idx=3)
    missing, unexpected = ref.load_state_dict(m.state_dict(), strict=True)
    assert not missing and not unexpected
    x = torch.randn(2, 7, m.hidden_size)
    mask = torch.full((7, 7), float("-inf")).triu(1)[None, None].expand(2, 1, 7, 7)
    with torch.no_grad():
        want, _ = ref(x, attention_mask=mask)
        for impl in ("naive", "absorb"):
            m.attn_impl = impl
            assert rel(m(x), want) < 1e-5


def test_auto_picks_naive_for_prefill_and_absorb_for_cached_decode(monkeypatch):
    m = _layer(seed=7)
    calls = []
    for name in ("_naive", "_absorb"):
        fn = getattr(m, name)
        monkeypatch.setattr(m, name, lambda *a, _fn=fn, _n=name: calls.append(_n) or _fn(*a))
    st = MLAState(1, m.kv_lora_rank, m.qk_rope_head_dim)
    x = torch.randn(1, 10 + 2 * m.absorb_max_tokens, m.hidden_size)
    with torch.no_grad():
        m(x[:, :8])                                   # no cache
        m(x[:, :8], st)                               # prefill into an empty cache
        m(x[:, 8:9], st)                              # decode
        m(x[:, 9:9 + m.absorb_max_tokens], st)        # short continuation
        m(x[:, 9 + m.absorb_max_tokens:], st)         # long continuation
    assert calls == ["_naive", "_naive", "_absorb", "_absorb", "_naive"]


def test_bf16_decode_tracks_fp32():
    m = _layer(seed=8)
    x = torch.randn(2, 12, m.hidden_size)
    with torch.no_grad():
        want = m(x)
        m.to(torch.bfloat16)
        st, xb = MLAState(2, m.kv_lora_rank, m.qk_rope_head_dim), x.bfloat16()
        got = torch.cat([m(xb[:, :8], st)] + [m(xb[:, t:t + 1], st) for t in range(8, 12)], 1)
    assert st.c.dtype == torch.bfloat16 and got.dtype == torch.bfloat16
    assert rel(got.float(), want) < 3e-2
