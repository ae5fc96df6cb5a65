"""Long-context MLA prefill: the query-chunked naive path equals one unchunked pass and an
independent dense reference, with and without a cached prefix, for equal and mixed row lengths."""

import math

import pytest
import torch

from k3.config import get_preset
from k3.model.cache import MLAState
from k3.model.mla import GatedMLA


def _layer(seed=0):
    cfg = get_preset("nano").replace(num_attention_heads=3, kv_lora_rank=24, qk_nope_head_dim=12,
                                     qk_rope_head_dim=8, v_head_dim=10)
    torch.manual_seed(seed)
    m = GatedMLA(cfg, layer_idx=3, attn_impl="naive")
    with torch.no_grad():
        for n, p in m.named_parameters():
            if "layernorm" in n:
                p.uniform_(0.5, 1.5)
    return m


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def dense(m: GatedMLA, x: torch.Tensor) -> torch.Tensor:
    """Causal MLA of x [1, T, H] from the raw weights: per head, explicit [T, T] scores."""
    nh, n, p, v, r = m.num_heads, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim, m.kv_lora_rank
    T = x.shape[1]

    def rms(t, w, eps):
        return w * t / torch.sqrt(t.pow(2).mean(-1, keepdim=True) + eps)

    q = rms(x @ m.q_a_proj.weight.T, m.q_a_layernorm.weight, m.q_a_layernorm.eps) @ m.q_b_proj.weight.T
    kv = x @ m.kv_a_proj_with_mqa.weight.T
    c, k_pe = rms(kv[..., :r], m.kv_a_layernorm.weight, m.kv_a_layernorm.eps), kv[..., r:]
    outs = []
    for h in range(nh):
        rows = m.kv_b_proj.weight[h * (n + v):(h + 1) * (n + v)]
        kh, vh = torch.cat([c @ rows[:n].T, k_pe], -1), c @ rows[n:].T
        s = q[..., h * (n + p):(h + 1) * (n + p)] @ kh.transpose(1, 2) / math.sqrt(n + p)
        s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
        outs.append(torch.softmax(s, -1) @ vh)
    o = torch.cat(outs, -1) * torch.sigmoid(x @ m.g_proj.weight.T)
    return o @ m.o_proj.weight.T


def _count_sdpa(monkeypatch):
    import torch.nn.functional as F

    calls, real = [], F.scaled_dot_product_attention

    def spy(q, k, v, **kw):
        calls.append((q.shape[2], k.shape[2]))
        return real(q, k, v, **kw)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    return calls


def test_chunked_prefill_equals_one_pass_and_dense(monkeypatch):
    m = _layer()
    x = torch.randn(2, 37, m.hidden_size)
    with torch.no_grad():
        one = m(x)
        m.prefill_query_chunk = 5
        calls = _count_sdpa(monkeypatch)
        chunked = m(x)
    assert calls == [(5, 5 * (i + 1)) for i in range(7)] + [(2, 37)]  # 8 chunks, causal key ranges
    assert rel(chunked, one) < 1e-6
    for b in range(2):
        assert rel(chunked[b:b + 1], dense(m, x[b:b + 1])) < 1e-5


def test_chunked_prefill_over_a_cached_prefix(monkeypatch):
    m = _layer(1)
    x = torch.randn(1, 41, m.hidden_size)
    with torch.no_grad():
        want = dense(m, x)
        m.prefill_query_chunk = 4
        st = MLAState(1, m.kv_lora_rank, m.qk_rope_head_dim)
        calls = _count_sdpa(monkeypatch)
        got = torch.cat([m(x[:, :11], st), m(x[:, 11:], st)], 1)
    assert len(calls) == 3 + 8 and calls[3] == (4, 15) and calls[-1] == (2, 41)
    assert st.length == 41 and rel(got, want) < 1e-5


def test_chunked_prefill_with_rows_of_different_lengths():
    m = _layer(2)
    xs = [torch.randn(1, n, m.hidden_size) for n in (3, 10)]
    new = torch.randn(2, 13, m.hidden_size)
    with torch.no_grad():
        states = []
        for x in xs:
            st = MLAState(1, m.kv_lora_rank, m.qk_rope_head_dim)
            m(x, st)
            states.append(st)
        st = MLAState.cat(states)
        m.prefill_query_chunk = 3
        got = m(new, st)
        for b, x in enumerate(xs):
            assert rel(got[b:b + 1], dense(m, torch.cat([x, new[b:b + 1]], 1))[:, -13:]) < 1e-5


def test_score_budget_shrinks_query_chunks(monkeypatch):
    m = _layer(3)
    x = torch.randn(1, 70, m.hidden_size)
    with torch.no_grad():
        want = m(x)
        m.score_budget = 3 * 70 * 20              # B·nh·rows·S ≤ budget -> 20 query rows per call
        calls = _count_sdpa(monkeypatch)
        got = m(x)
    assert [q for q, _ in calls] == [20, 20, 20, 10]
    assert rel(got, want) < 1e-6


def test_training_keeps_one_fused_causal_call(monkeypatch):
    m = _layer(4)
    m.prefill_query_chunk = 4
    x = torch.randn(1, 9, m.hidden_size, requires_grad=True)
    calls = _count_sdpa(monkeypatch)
    m(x).sum().backward()
    assert calls == [(9, 9)] and x.grad is not None
