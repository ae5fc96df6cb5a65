"""The decode step's C row math (``k3.ops.decode_rows``) on its own: the vector exp / sigmoid / tanh /
SiLU against float64 over fp32's range; the KDA step against a per-head loop in float64 (both gate
forms), a row's result independent of its batch, ordinary outputs under inference mode; the AttnRes
mix against the training mix; the gated activation against its formula; the router against an exact
ranking with ties; the radix sort against torch's stable sort; bad shapes refused next to the same
call working."""

from __future__ import annotations

import math

import pytest
import torch

from k3.ops.attn_res import attn_res_mix
from k3.ops.decode_rows import MAP_KINDS, attn_res_mix_c, gated_act_c, kda_step_c, map_c, route_c, sort_desc

_F64 = {"exp": torch.exp, "sigmoid": torch.sigmoid, "tanh": torch.tanh, "silu": torch.nn.functional.silu}


@pytest.mark.parametrize("kind", MAP_KINDS)
def test_vector_functions_are_within_a_few_ulp_of_float64(kind):
    x = torch.cat([torch.linspace(-87, 88, 200_001), torch.linspace(-1e-3, 1e-3, 2001),
                   torch.tensor([0.0, -0.0, 1e-30, -1e-30, 0.6249, 0.6251, -0.625])])
    if kind != "exp":
        x = torch.cat([x, torch.tensor([-200.0, 200.0, -1e4, 1e4])])
    got = map_c(kind, x).double()
    want = _F64[kind](x.double())
    tiny = want.abs() < 1e-30   # flushed to 0 where float64 is below fp32's normal range
    rel = ((got - want).abs() / want.abs().clamp_min(1e-38))[~tiny]
    assert float(rel.max()) < 4 * 2 ** -23, (kind, float(rel.max()))
    assert torch.all(got[tiny].abs() < 1e-30)
    assert torch.isfinite(got).all()


def test_map_refuses_unknown_kinds_and_dtypes():
    assert torch.equal(map_c("exp", torch.zeros(3)), torch.ones(3))   # the control
    with pytest.raises(ValueError, match="kind must be one of"):
        map_c("gelu", torch.zeros(3))
    with pytest.raises(ValueError, match="fp32"):
        map_c("exp", torch.zeros(3, dtype=torch.float64))


def _kda_reference(qkv, conv, conv_w, dec_in, lb, neg_a, beta_in, gate, S, c_qk, q_scale, c_o):
    """The step head by head in float64, with explicit loops over the state (independent of the C)."""
    B, nh, d, _ = S.shape
    P = nh * d
    qkv, conv, conv_w, dec_in, beta_in, gate, S = (t.double() for t in (qkv, conv, conv_w, dec_in, beta_in, gate, S))
    xp = torch.cat([conv, qkv[:, :, None]], 2)
    h = torch.nn.functional.silu((xp * conv_w).sum(-1))
    o_all = torch.zeros(B, P, dtype=torch.float64)
    S_new = torch.zeros_like(S)
    for b in range(B):
        for hd in range(nh):
            sl = slice(hd * d, (hd + 1) * d)
            q, k, v = h[b, sl], h[b, P:2 * P][sl], h[b, 2 * P:][sl]
            q = q / math.sqrt(float(q @ q) + c_qk) * q_scale
            k = k / math.sqrt(float(k @ k) + c_qk)
            g = dec_in[b, sl]
            e = torch.exp(lb * torch.sigmoid(g)) if lb is not None else torch.exp(neg_a[sl].double() *
                                                                                   torch.nn.functional.softplus(g))
            beta = 1 / (1 + math.exp(-float(beta_in[b, hd])))
            Sd = S[b, hd] * e[:, None]
            u = beta * (v - k @ Sd)
            Sn = Sd + torch.outer(k, u)
            o = q @ Sn
            o = o / math.sqrt(float(o @ o) + c_o) * torch.sigmoid(gate[b, sl])
            o_all[b, sl], S_new[b, hd] = o, Sn
    return o_all, xp[:, :, 1:], S_new


def _kda_inputs(B, nh, d, K, seed):
    g = torch.Generator().manual_seed(seed)
    P = nh * d
    wide = torch.randn(B, 3 * P + 2 * P + nh + 7, generator=g)     # the inputs as column slices of one row
    qkv, dec_in, gate = wide[:, :3 * P], wide[:, 3 * P:4 * P], wide[:, 4 * P:5 * P]
    beta_in = wide[:, 5 * P:5 * P + nh]
    conv = torch.randn(B, 3 * P, K - 1, generator=g)
    conv_w = torch.randn(3 * P, K, generator=g) * 0.5
    S = torch.randn(B, nh, d, d, generator=g) * 0.3
    neg_a = -torch.rand(P, generator=g) * 2
    return qkv, conv, conv_w, dec_in, neg_a, beta_in, gate, S


@pytest.mark.parametrize("lb", [-5.0, None])        # K3's lower-bounded gate, Kimi-Linear's softplus gate
@pytest.mark.parametrize("B,nh,d,K", [(1, 2, 32, 4), (3, 4, 64, 4), (1, 2, 128, 3), (2, 1, 20, 2), (1, 1, 144, 3)])
def test_kda_step_equals_a_float64_loop(lb, B, nh, d, K):
    qkv, conv, conv_w, dec_in, neg_a, beta_in, gate, S = _kda_inputs(B, nh, d, K, B + d)
    args = (qkv, conv, conv_w, dec_in, lb, neg_a, beta_in, gate, S, 1e-6, d ** -0.5, d * 1e-5)
    o, conv2, S2 = kda_step_c(*args)
    wo, wconv, wS = _kda_reference(*args)
    for got, want in ((o, wo), (S2, wS)):
        assert float((got.double() - want).abs().max() / want.abs().max()) < 1e-5
    assert torch.equal(conv2, wconv.float())        # the shifted window is a copy


def test_kda_step_rows_are_batch_invariant_and_outputs_ordinary():
    qkv, conv, conv_w, dec_in, neg_a, beta_in, gate, S = _kda_inputs(5, 4, 64, 4, 0)
    with torch.inference_mode():
        o, conv2, S2 = kda_step_c(qkv, conv, conv_w, dec_in, -5.0, neg_a, beta_in, gate, S, 1e-6, 0.125, 6.4e-4)
        plain = torch.mul(S2, 1)
    assert not conv2.is_inference() and not S2.is_inference()
    assert plain.is_inference()                      # the control: a torch op there makes one
    for b in range(5):
        one = kda_step_c(qkv[b:b + 1], conv[b:b + 1].contiguous(), conv_w, dec_in[b:b + 1], -5.0, neg_a,
                         beta_in[b:b + 1], gate[b:b + 1], S[b:b + 1].contiguous(), 1e-6, 0.125, 6.4e-4)
        assert torch.equal(one[0], o[b:b + 1]) and torch.equal(one[2], S2[b:b + 1])


def test_kda_step_refuses_wrong_shapes():
    qkv, conv, conv_w, dec_in, neg_a, beta_in, gate, S = _kda_inputs(2, 2, 32, 4, 1)
    ok = kda_step_c(qkv, conv, conv_w, dec_in, None, neg_a, beta_in, gate, S, 1e-6, 0.17, 3e-4)
    assert ok[0].shape == (2, 64)                    # the control
    with pytest.raises(ValueError, match=r"qkv: expected fp32 CPU rows \[2, 192\]"):
        kda_step_c(qkv[:, 1:], conv, conv_w, dec_in, None, neg_a, beta_in, gate, S, 1e-6, 0.17, 3e-4)
    with pytest.raises(ValueError, match="S: expected a contiguous"):
        kda_step_c(qkv, conv, conv_w, dec_in, None, neg_a, beta_in, gate, S.transpose(2, 3), 1e-6, 0.17, 3e-4)
    with pytest.raises(ValueError, match="neg_a"):
        kda_step_c(qkv, conv, conv_w, dec_in, None, neg_a[:5], beta_in, gate, S, 1e-6, 0.17, 3e-4)
    with pytest.raises(ValueError, match="conv: expected"):
        kda_step_c(qkv, conv.double(), conv_w, dec_in, None, neg_a, beta_in, gate, S, 1e-6, 0.17, 3e-4)


@pytest.mark.parametrize("n", [2, 3, 6])
def test_attn_res_mix_equals_the_training_mix(n):
    g = torch.Generator().manual_seed(n)
    H = 48
    srcs = [torch.randn(4, H, generator=g) * (i + 1) for i in range(n)]
    w, gamma = torch.randn(H, generator=g), 1 + 0.2 * torch.randn(H, generator=g)
    want = attn_res_mix(srcs, w, gamma, 1e-5)
    got = attn_res_mix_c(gamma * w * H ** 0.5, H * 1e-5, srcs)
    assert float((got - want).abs().max() / want.abs().max()) < 1e-5
    assert attn_res_mix_c(gamma * w, 1e-5, srcs[:1]) is srcs[0]
    with pytest.raises(ValueError, match=r"source 1: expected fp32 CPU rows \[4, 48\]"):
        attn_res_mix_c(gamma * w, 1e-5, [srcs[0], srcs[1][:, :40]])


@pytest.mark.parametrize("silu,tanh_up", [(True, False), (False, True), (False, False)])
def test_gated_act_equals_the_formula_in_float64(silu, tanh_up):
    g = torch.Generator().manual_seed(int(silu) + 2 * int(tanh_up))
    wide = torch.randn(5, 2 * 37, generator=g) * 4          # g and u as column halves of one row (F not 16k)
    gate, up = wide[:, :37], wide[:, 37:]
    row_w = torch.rand(5, generator=g)
    got = gated_act_c(gate, up, silu, 0.7, tanh_up, row_w).double()
    G, U = gate.double(), up.double()
    if silu:
        want = torch.nn.functional.silu(G) * U
    else:
        want = torch.tanh(G * 0.7) * torch.sigmoid(G) * (torch.tanh(U) if tanh_up else U)
    want = want * row_w.double()[:, None]
    assert float((got - want).abs().max() / want.abs().max()) < 1e-6
    assert torch.equal(gated_act_c(gate, up, silu, 0.7, tanh_up), gated_act_c(gate, up, silu, 0.7, tanh_up,
                                                                             torch.ones(5)))


def _route_reference(logits, bias, k, softmax, renorm, tiny):
    """Exact enumeration: experts ranked by (score + bias descending, index ascending)."""
    idx, ws = [], []
    for z in logits.double():
        s = z.softmax(0) if softmax else torch.sigmoid(z)
        key = s + bias.double()
        order = sorted(range(len(z)), key=lambda e: (-float(key[e]), e))[:k]
        w = s[order]
        idx.append(order), ws.append(w / (w.sum() + tiny) if renorm else w)
    return torch.tensor(idx), torch.stack(ws)


@pytest.mark.parametrize("softmax,renorm", [(False, True), (True, False)])
def test_route_equals_an_exact_ranking_with_ties(softmax, renorm):
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 16, generator=g)
    logits[1] = 0.25                                         # a row of ties: the lowest indices win
    logits[2, [3, 9, 12]] = 5.0                              # a tie inside the top k
    bias = torch.zeros(16)
    bias[5] = 0.01
    idx, w = route_c(logits, bias, 4, softmax, renorm, 1e-20)
    widx, ww = _route_reference(logits, bias, 4, softmax, renorm, 1e-20)
    assert torch.equal(idx, widx)
    assert float((w.double() - ww).abs().max()) < 1e-6
    assert idx[1].tolist() == [5, 0, 1, 2]                   # the bias breaks the tie for expert 5


def test_route_and_act_refuse_bad_shapes():
    logits, bias = torch.randn(2, 8), torch.zeros(8)
    assert route_c(logits, bias, 8, False, True, 1e-20)[0].shape == (2, 8)      # the control: k = E works
    with pytest.raises(ValueError, match=r"top-k 9 must be in \[1, 8\]"):
        route_c(logits, bias, 9, False, True, 1e-20)
    with pytest.raises(ValueError, match=r"bias: expected a contiguous fp32 CPU tensor \[8\]"):
        route_c(logits, torch.zeros(7), 2, False, True, 1e-20)
    with pytest.raises(ValueError, match=r"u: expected fp32 CPU rows \[2, 8\]"):
        gated_act_c(logits, logits[:, :7], True, 1.0, False)


def test_sort_desc_is_torchs_stable_descending_sort_bit_for_bit():
    """The C radix sort against torch.sort(descending=True, stable=True): ties (their index order),
    NaN, ±inf and ±0.0, bit for bit in values and indices; other dtypes go to torch itself."""
    g = torch.Generator().manual_seed(0)
    for trial in range(120):
        R, V = int(torch.randint(1, 9, (1,), generator=g)), int(torch.randint(1, 300, (1,), generator=g))
        z = torch.randn(R, V, generator=g)
        if trial % 3 == 0:
            z = (z * 2).round() / 2                                    # many ties
        if trial % 4 == 0:
            flat = z.view(-1)
            for value, n in ((float("nan"), 5), (float("inf"), 3), (float("-inf"), 3), (-0.0, 4), (0.0, 4)):
                flat[torch.randint(0, R * V, (n,), generator=g)] = value
        got, want = sort_desc(z), z.sort(dim=-1, descending=True, stable=True)
        assert torch.equal(got.indices, want.indices), trial
        assert torch.equal(got.values.view(torch.int32), want.values.view(torch.int32)), trial
    z64 = torch.randn(3, 50, dtype=torch.float64, generator=g)
    got = sort_desc(z64)
    want = z64.sort(dim=-1, descending=True, stable=True)
    assert got.values.dtype == torch.float64 and torch.equal(got.indices, want.indices)
