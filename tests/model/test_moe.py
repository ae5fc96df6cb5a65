"""LatentMoE: sort + grouped_mm dispatch and the capacity path against a per-token loop."""

import math

import pytest
import torch

from k3.config import get_preset
from k3.model.moe import LatentMoE, grouped_linear
from k3.model.stats import ForwardStats
from k3.ops.routing import quantile_balance_update
from k3.train.balance import RouterBalancer

torch.manual_seed(0)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny matmuls: one thread avoids oversubscription stalls on a shared 2-core machine."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def make_cfg(**kw):
    base = dict(hidden_size=32, num_experts=8, num_experts_per_token=2, num_shared_experts=1,
                moe_intermediate_size=16, routed_expert_hidden_size=24, latent_moe_use_norm=True)
    base.update(kw)
    return get_preset("nano", **base)


def act_ref(cfg, g, u):
    if cfg.hidden_act == "silu":
        return g * torch.sigmoid(g) * u
    b, lb = cfg.activation_situ_beta, cfg.activation_situ_linear_beta
    return b * torch.tanh(g / b) * torch.sigmoid(g) * (lb * torch.tanh(u / lb))


def route_ref(cfg, bias, logits):
    """Per-token routing written out: biased selection, unbiased renormalized weights."""
    n, e = logits.shape
    act = torch.sigmoid if cfg.moe_router_activation_func == "sigmoid" else lambda t: torch.softmax(t, -1)
    out_w, out_i = [], []
    for t in range(n):
        s = act(logits[t].float())
        sel = s.detach() + bias
        if cfg.num_expert_group > 1:
            gsz = e // cfg.num_expert_group
            gscore = [sorted(sel[g * gsz:(g + 1) * gsz].tolist(), reverse=True)[:2] for g in range(cfg.num_expert_group)]
            gscore = torch.tensor([sum(v) for v in gscore])
            keep = gscore.topk(cfg.topk_group).indices.tolist()
            sel = torch.stack([sel[j] if j // gsz in keep else torch.tensor(-1e9) for j in range(e)])
        idx = sel.topk(cfg.num_experts_per_token).indices
        w = s[idx]
        if cfg.moe_renormalize:
            w = w / (w.sum() + 1e-20)
        out_w.append(w * cfg.routed_scaling_factor)
        out_i.append(idx)
    return torch.stack(out_w), torch.stack(out_i)


def moe_ref(m, cfg, x, capacity=None):
    """Loop over tokens and their k experts; `capacity` drops slots past C per expert in token order."""
    x2 = x.reshape(-1, cfg.hidden_size)
    logits = x2.float() @ m.gate.weight.float().T
    w, idx = route_ref(cfg, m.gate.e_score_correction_bias, logits)
    z = m.routed_expert_down_proj(x2) if cfg.routed_expert_hidden_size else x2
    used = [0] * cfg.num_experts
    rows = []
    for t in range(x2.shape[0]):
        acc = torch.zeros(z.shape[-1])
        for j in range(cfg.num_experts_per_token):
            e = int(idx[t, j])
            used[e] += 1
            if capacity is not None and used[e] > capacity:
                continue
            ex = m.experts
            h = act_ref(cfg, z[t] @ ex.w1[e].T, z[t] @ ex.w3[e].T) @ ex.w2[e].T
            acc = acc + w[t, j] * h
        rows.append(acc)
    u = torch.stack(rows)
    if cfg.routed_expert_hidden_size:
        if cfg.latent_moe_use_norm:
            nw = m.routed_expert_norm.weight
            u = nw * u * torch.rsqrt(u.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps)
        y = m.routed_expert_up_proj(u)
    else:
        y = u
    if cfg.num_shared_experts:
        se = m.shared_experts
        y = y + se.down_proj(act_ref(cfg, se.gate_proj(x2), se.up_proj(x2)))
    return y.reshape(x.shape)


def grads(out, params, gy):
    return torch.autograd.grad(out, params, gy, allow_unused=True)


CASES = {
    "latent_norm_sigmoid": dict(),
    "latent_no_norm": dict(latent_moe_use_norm=False),
    "plain_silu": dict(routed_expert_hidden_size=None, latent_moe_use_norm=False, hidden_act="silu",
                       activation_situ_linear_beta=None, routed_scaling_factor=2.5),
    "shared_0": dict(num_shared_experts=0),
    "shared_2": dict(num_shared_experts=2),
    "softmax": dict(moe_router_activation_func="softmax"),
    "grouped": dict(num_expert_group=4, topk_group=2, num_experts_per_token=3),
    "odd_widths": dict(hidden_size=20, routed_expert_hidden_size=10, moe_intermediate_size=6),
    "no_renormalize": dict(moe_renormalize=False, num_experts_per_token=3),
}


@pytest.mark.parametrize("name", list(CASES))
def test_dispatch_matches_per_token_loop_outputs_and_grads(name):
    """Both the sorted grouped_mm path and the capacity path (C = N: nothing dropped)."""
    cfg = make_cfg(**CASES[name])
    torch.manual_seed(1)
    m = LatentMoE(cfg)
    with torch.no_grad():  # a non-trivial bias so selection differs from the plain top-k
        m.gate.e_score_correction_bias.copy_(torch.randn(cfg.num_experts) * 0.05)
        if hasattr(m, "routed_expert_norm"):
            m.routed_expert_norm.weight.copy_(1 + 0.1 * torch.randn(cfg.expert_dim))
    x = torch.randn(2, 4, cfg.hidden_size, requires_grad=True)
    params = [x] + [p for p in m.parameters()]
    y_ref = moe_ref(m, cfg, x)
    gy = torch.randn_like(y_ref)
    g_ref = grads(y_ref, params, gy)
    for cap in (None, cfg.num_experts / cfg.num_experts_per_token):
        m.capacity_factor = cap
        y = m(x)
        assert y.shape == x.shape
        torch.testing.assert_close(y, y_ref, rtol=1e-4, atol=1e-5)
        for g, gr in zip(grads(y, params, gy), g_ref):
            assert g is not None
            torch.testing.assert_close(g, gr, rtol=1e-4, atol=1e-5)
    assert m.gate.e_score_correction_bias.grad is None
    assert not m.gate.e_score_correction_bias.requires_grad


def test_capacity_drops_later_tokens_past_capacity():
    cfg = make_cfg(num_experts=4, num_experts_per_token=2)
    torch.manual_seed(2)
    m = LatentMoE(cfg, capacity_factor=0.5)
    with torch.no_grad():  # skew the router so some experts overflow
        m.gate.e_score_correction_bias.copy_(torch.tensor([0.3, 0.2, 0.0, 0.0]))
    x = torch.randn(16, cfg.hidden_size)
    cap = m.capacity(16, 0.5)
    assert cap == math.ceil(0.5 * 16 * 2 / 4) == 4
    st = ForwardStats()
    y = m(x, stats=st)
    r = st.router[m]
    assert int(r.counts.max()) > cap  # something was really dropped
    assert int(r.dropped) == int((r.counts - cap).clamp_min(0).sum())
    torch.testing.assert_close(y, moe_ref(m, cfg, x, capacity=cap), rtol=1e-4, atol=1e-5)
    m.capacity_factor = None
    assert not torch.allclose(m(x), y, atol=1e-5)


def test_routing_weights_are_unbiased_and_bias_changes_selection():
    cfg = make_cfg()
    m = LatentMoE(cfg)
    x = torch.randn(40, cfg.hidden_size)
    w0, i0, s0 = m.gate(x)
    with torch.no_grad():
        m.gate.e_score_correction_bias[5] = 10.0
    w1, i1, s1 = m.gate(x)
    assert (i1 == 5).any(-1).all() and not (i0 == 5).any(-1).all()
    torch.testing.assert_close(s1, s0)
    expect = s1.gather(1, i1)
    torch.testing.assert_close(w1, expect / expect.sum(-1, keepdim=True))


def test_router_stats_come_back_from_the_forward_and_quantile_step_is_causal():
    cfg = make_cfg(num_experts=8, num_experts_per_token=2)
    m = LatentMoE(cfg)
    with torch.no_grad():
        m.gate.weight.add_(torch.linspace(-0.5, 0.5, 8)[:, None] * 0.3)
    x = torch.randn(64, cfg.hidden_size)
    attrs = set(vars(m))
    assert not any(a.startswith(("last_", "record_")) for a in attrs)   # no statistics switches or slots
    assert m(x) is not None and set(vars(m)) == attrs    # no stats asked: nothing measured or kept
    st = ForwardStats()
    y_t = m(x, stats=st)
    assert set(vars(m)) == attrs                         # the forward sets nothing on the layer
    counts_t, scores_t = st.router[m].counts.clone(), st.router[m].scores.clone()
    assert scores_t.shape == (64, 8) and not st.router[m].scores.requires_grad
    assert st.router[m].dropped is None                  # the dropless path drops nothing
    assert int(counts_t.sum()) == 64 * 2
    torch.testing.assert_close(counts_t, torch.bincount(m.gate(x)[1].reshape(-1), minlength=8))
    bias_before = m.gate.e_score_correction_bias.clone()
    assert not hasattr(m, "quantile_balance_step")     # the layer only exposes its stats
    bal = RouterBalancer([m], "quantile")
    bal.collect(st)
    stats = bal.update()
    assert set(stats) == {"load_cv", "load_max_over_mean"} and len(stats["load_cv"]) == 1
    want = quantile_balance_update(scores_t, bias_before, 2)
    assert torch.equal(m.gate.e_score_correction_bias, want)
    # the new bias acts only on the next forward (the recorded step's output is as routed)
    assert not torch.equal(m.gate.e_score_correction_bias, bias_before)
    m.gate.e_score_correction_bias.copy_(bias_before)
    torch.testing.assert_close(m(x), y_t)


def test_wrong_hidden_size_raises_value_error_naming_it():
    cfg = make_cfg()
    m = LatentMoE(cfg)
    with pytest.raises(ValueError, match="hidden size 32"):
        m(torch.randn(2, 3, 31))


def test_state_dict_names_and_shapes():
    cfg = make_cfg()
    sd = LatentMoE(cfg).state_dict()
    E, H, L, Fi = 8, 32, 24, 16
    expect = {
        "gate.weight": (E, H), "gate.e_score_correction_bias": (E,),
        "routed_expert_down_proj.weight": (L, H), "routed_expert_norm.weight": (L,),
        "routed_expert_up_proj.weight": (H, L),
        "experts.w1": (E, Fi, L), "experts.w3": (E, Fi, L), "experts.w2": (E, L, Fi),
        "shared_experts.gate_proj.weight": (Fi, H), "shared_experts.up_proj.weight": (Fi, H),
        "shared_experts.down_proj.weight": (H, Fi),
    }
    assert {k: tuple(v.shape) for k, v in sd.items()} == expect
    plain = LatentMoE(make_cfg(routed_expert_hidden_size=None, num_shared_experts=0)).state_dict()
    assert sorted(plain) == ["experts.w1", "experts.w2", "experts.w3", "gate.e_score_correction_bias",
                             "gate.weight"]
    assert plain["experts.w1"].shape == (E, Fi, H)


def test_bias_stays_fp32_in_bf16_model_and_bf16_forward_tracks_fp32():
    cfg = make_cfg()
    m = LatentMoE(cfg)
    with torch.no_grad():
        m.gate.e_score_correction_bias.copy_(torch.randn(8) * 1e-3 + 1.0)
    b32 = m.gate.e_score_correction_bias.clone()
    x = torch.randn(64, cfg.hidden_size)
    y32 = m(x)
    m.to(torch.bfloat16)
    assert m.gate.e_score_correction_bias.dtype == torch.float32
    assert torch.equal(m.gate.e_score_correction_bias, b32)
    with torch.device("meta"):
        meta = LatentMoE(cfg).to(torch.bfloat16)
    assert meta.gate.e_score_correction_bias.dtype == torch.float32
    y16 = m(x.bfloat16())
    assert y16.dtype == torch.bfloat16
    rel = (y16.float() - y32).norm() / y32.norm()
    assert rel < 0.05


def test_autocast_bf16_forward_backward():
    cfg = make_cfg()
    m = LatentMoE(cfg)
    x = torch.randn(4, 6, cfg.hidden_size, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = m(x)
    y.float().square().mean().backward()
    assert torch.isfinite(x.grad).all() and torch.isfinite(m.experts.w2.grad).all()
    assert m.experts.w1.grad.dtype == torch.float32


def test_grouped_linear_matches_loop_with_empty_groups_and_odd_widths():
    x = torch.randn(9, 7, requires_grad=True)
    w = torch.randn(4, 5, 7, requires_grad=True)
    offs = torch.tensor([2, 2, 9, 9], dtype=torch.int32)
    y = grouped_linear(x, w, offs)
    ref = torch.cat([x[:2] @ w[0].T, x[2:9] @ w[2].T])
    torch.testing.assert_close(y, ref)
    gy = torch.randn_like(y)
    ga = torch.autograd.grad(y, (x, w), gy)
    gb = torch.autograd.grad(ref, (x, w), gy)
    for a, b in zip(ga, gb):
        torch.testing.assert_close(a, b)


def test_grouped_linear_inference_path_matches_loop():
    """Under no_grad on CPU only the non-empty groups run (the decode path); same products."""
    x, w = torch.randn(9, 7), torch.randn(4, 5, 7)
    offs = torch.tensor([0, 2, 2, 9], dtype=torch.int32)       # groups 0 and 2 empty
    ref = torch.cat([x[:2] @ w[1].T, x[2:9] @ w[3].T])
    with torch.no_grad():
        torch.testing.assert_close(grouped_linear(x, w, offs), ref)
        torch.testing.assert_close(grouped_linear(x.bfloat16(), w, offs), ref.bfloat16(), rtol=2e-2, atol=2e-2)
        assert grouped_linear(x[:0], w, torch.zeros(4, dtype=torch.int32)).shape == (0, 5)


def test_empty_batch_and_single_token():
    cfg = make_cfg()
    m = LatentMoE(cfg)
    assert m(torch.randn(0, cfg.hidden_size)).shape == (0, cfg.hidden_size)
    x = torch.randn(1, 1, cfg.hidden_size)
    torch.testing.assert_close(m(x), moe_ref(m, cfg, x), rtol=1e-4, atol=1e-5)


def test_flops_per_token_counts_active_matmuls():
    cfg = make_cfg()
    m = LatentMoE(cfg)
    H, L, Fi, E, k = 32, 24, 16, 8, 2
    assert m.flops_per_token() == 2 * (H * E + 2 * H * L + k * 3 * L * Fi + 3 * H * Fi)
