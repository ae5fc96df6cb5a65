"""KimiDeltaAttention layer: an independent token-loop reference, cache continuation ≡ one pass,
conv state, gate modes, fp32 decay parameters, and agreement with transformers' KimiLinearDeltaAttention."""

import pytest
import torch
import torch.nn.functional as F

from k3.config import get_preset
from k3.model.cache import K3Cache, KDAState, MLAState
from k3.model.kda import KimiDeltaAttention


def _cfg(lower_bound=-5.0, full_rank=True, heads=2, head_dim=16, kernel=4):
    cfg = get_preset("nano")
    lac = cfg.linear_attn_config.to_dict()
    lac.update(num_heads=heads, head_dim=head_dim, short_conv_kernel_size=kernel, gate_lower_bound=lower_bound,
               use_full_rank_gate=full_rank)
    return cfg.replace(linear_attn_config=lac)


def _layer(seed=0, **kw):
    torch.manual_seed(seed)
    m = KimiDeltaAttention(_cfg(**kw), layer_idx=0)
    with torch.no_grad():
        m.o_norm.weight.uniform_(0.5, 1.5)  # so that a missing output norm weight would show
        m.f_b_proj.weight.mul_(10)          # decays spread over (lb, 0), not all near the init's tiny dt
    return m


def _state(m, batch):
    return KDAState(batch, m.num_heads, m.head_dim, m.conv_kernel_size)


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def reference(m: KimiDeltaAttention, x: torch.Tensor) -> torch.Tensor:
    """SPEC §3.1 from the raw weights: explicit conv taps, per-token delta rule loop."""
    B, T, _ = x.shape
    nh, d, K = m.num_heads, m.head_dim, m.conv_kernel_size

    def short_conv(u, w):  # u [B,T,P], w [P,1,K]: out_t = Σ_j w_j u_{t-K+1+j}
        out = torch.zeros_like(u)
        for j in range(K):
            shift = K - 1 - j
            out[:, shift:] += w[:, 0, j] * u[:, :T - shift]
        return F.silu(out)

    def heads(t):
        return t.reshape(B, T, nh, d)

    q = heads(short_conv(x @ m.q_proj.weight.T, m.q_conv1d.weight))
    k = heads(short_conv(x @ m.k_proj.weight.T, m.k_conv1d.weight))
    v = heads(short_conv(x @ m.v_proj.weight.T, m.v_conv1d.weight))
    q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6) * d ** -0.5
    k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    f = heads(x @ m.f_a_proj.weight.T @ m.f_b_proj.weight.T + m.dt_bias)
    a = m.A_log.exp()[:, None]
    if m.gate_lower_bound is None:
        g = -a * F.softplus(f)
    else:
        g = m.gate_lower_bound * torch.sigmoid(a * f)
    beta = torch.sigmoid(x @ m.b_proj.weight.T)  # [B,T,nh]
    S = torch.zeros(B, nh, d, d)
    outs = []
    for t in range(T):
        S = S * g[:, t].exp()[..., None]
        err = v[:, t] - torch.einsum("bhkv,bhk->bhv", S, k[:, t])
        S = S + beta[:, t, :, None, None] * k[:, t, :, :, None] * err[:, :, None, :]
        outs.append(torch.einsum("bhkv,bhk->bhv", S, q[:, t]))
    o = torch.stack(outs, 1)  # [B,T,nh,d]
    o = o / torch.sqrt(o.pow(2).mean(-1, keepdim=True) + m.o_norm.eps) * m.o_norm.weight
    gate = x @ m.g_proj.weight.T if m.use_full_rank_gate else x @ m.g_a_proj.weight.T @ m.g_b_proj.weight.T
    o = o * torch.sigmoid(heads(gate))
    return o.reshape(B, T, nh * d) @ m.o_proj.weight.T


MODES = [dict(lower_bound=-5.0, full_rank=True), dict(lower_bound=None, full_rank=True),
         dict(lower_bound=-5.0, full_rank=False), dict(lower_bound=None, full_rank=False)]


@pytest.mark.parametrize("mode", MODES)
def test_forward_matches_token_loop_reference(mode):
    m = _layer(**mode)
    x = torch.randn(2, 70, m.hidden_size)  # crosses a 64-token chunk boundary
    with torch.no_grad():
        assert rel(m(x), reference(m, x)) < 1e-5


@pytest.mark.parametrize("mode", [MODES[0], MODES[3]])
def test_prefill_decode_and_chunked_continuation_match_full_forward(mode):
    m = _layer(seed=1, **mode)
    x = torch.randn(2, 90, m.hidden_size)
    with torch.no_grad():
        full = m(x)
        st = _state(m, 2)
        pieces = [m(x[:, :20], st)]                                   # prefill
        pieces += [m(x[:, t:t + 1], st) for t in range(20, 24)]       # recurrent decode
        pieces.append(m(x[:, 24:85], st))                             # chunked prefill on a non-empty state
        pieces += [m(x[:, t:t + 1], st) for t in range(85, 90)]
    assert rel(torch.cat(pieces, 1), full) < 1e-5
    assert st.recurrent.dtype == torch.float32 and st.recurrent.shape == (2, m.num_heads, m.head_dim, m.head_dim)


def test_short_prefills_below_kernel_width_keep_conv_history():
    m = _layer(seed=2, kernel=4)
    x = torch.randn(1, 7, m.hidden_size)
    with torch.no_grad():
        full = m(x)
        st = _state(m, 1)
        y0 = m(x[:, :1], st)      # T=1 on an empty state: conv history must be zeros + x0
        P = m.num_heads * m.head_dim
        qkv0 = torch.cat([m.q_proj(x[:, 0]), m.k_proj(x[:, 0]), m.v_proj(x[:, 0])], -1)  # [1, 3P]
        assert st.conv.shape == (1, 3 * P, 3)
        torch.testing.assert_close(st.conv[:, :, :2], torch.zeros(1, 3 * P, 2))
        torch.testing.assert_close(st.conv[:, :, 2], qkv0)
        y1 = m(x[:, 1:3], st)     # T=2 < K-1 through the chunk path
        ys = [m(x[:, t:t + 1], st) for t in range(3, 7)]
    assert rel(torch.cat([y0, y1, *ys], 1), full) < 1e-5


def test_kernel_size_one_has_no_conv_history():
    m = _layer(seed=3, kernel=1)
    x = torch.randn(2, 5, m.hidden_size)
    with torch.no_grad():
        st = _state(m, 2)
        y = torch.cat([m(x[:, :2], st), m(x[:, 2:3], st), m(x[:, 3:], st)], 1)
        assert st.conv.shape[-1] == 0
        assert rel(y, m(x)) < 1e-5 and rel(m(x), reference(m, x)) < 1e-5


def test_gradients_match_reference():
    m = _layer(seed=4, lower_bound=-5.0)
    x = torch.randn(1, 20, m.hidden_size)
    grads = []
    for fn in (m, lambda t: reference(m, t)):
        m.zero_grad()
        fn(x).pow(2).sum().backward()
        grads.append({n: p.grad.clone() for n, p in m.named_parameters()})
    for n in grads[0]:
        assert rel(grads[0][n], grads[1][n]) < 1e-4, n


def test_parameter_names_follow_the_gate_mode():
    full = set(dict(_layer(full_rank=True).named_parameters()))
    low = set(dict(_layer(full_rank=False).named_parameters()))
    assert full - low == {"g_proj.weight"} and low - full == {"g_a_proj.weight", "g_b_proj.weight"}
    m = _layer()
    P, d, H = m.num_heads * m.head_dim, m.head_dim, m.hidden_size
    shapes = {n: tuple(p.shape) for n, p in m.named_parameters()}
    assert shapes["q_conv1d.weight"] == (P, 1, m.conv_kernel_size) and shapes["A_log"] == (m.num_heads,)
    assert shapes["dt_bias"] == (P,) and shapes["f_a_proj.weight"] == (d, H) and shapes["o_norm.weight"] == (d,)


def test_init_follows_kimi_linear():
    torch.manual_seed(0)
    m = KimiDeltaAttention(_cfg(heads=64, head_dim=32), 0)
    A = m.A_log.exp()
    assert A.min() >= 1.0 and A.max() <= 16.0
    dt = F.softplus(m.dt_bias)
    assert dt.min() >= 1e-4 - 1e-9 and dt.max() <= 0.1 + 1e-6 and dt.min() < 2e-3 and dt.max() > 0.05
    assert torch.equal(m.o_norm.weight, torch.ones_like(m.o_norm.weight))
    assert abs(m.q_proj.weight.std().item() - 0.02) < 2e-3


def test_decay_parameters_stay_fp32_when_cast():
    m = _layer()
    A, dt = m.A_log.detach().clone(), m.dt_bias.detach().clone()
    m.to(torch.bfloat16)
    assert m.q_proj.weight.dtype == torch.bfloat16
    assert m.A_log.dtype == m.dt_bias.dtype == torch.float32
    assert torch.equal(m.A_log, A) and torch.equal(m.dt_bias, dt)  # original values, not a bf16 round trip
    assert isinstance(m.A_log, torch.nn.Parameter) and "A_log" in dict(m.named_parameters())
    x = torch.randn(1, 5, m.hidden_size, dtype=torch.bfloat16)
    assert m(x).dtype == torch.bfloat16
    m.half()
    assert m.A_log.dtype == torch.float32 and m.o_proj.weight.dtype == torch.float16
    with torch.device("meta"):
        big = KimiDeltaAttention(_cfg(heads=4), 0)
    big = big.to(torch.bfloat16).to_empty(device="cpu")  # the meta-init → materialise route
    assert big.A_log.dtype == torch.float32 and big.A_log.device.type == "cpu"


def test_bf16_cached_decode_tracks_fp32_with_fp32_recurrent_state():
    m = _layer(seed=7)
    x = torch.randn(1, 12, m.hidden_size)
    with torch.no_grad():
        want = m(x)
        m.to(torch.bfloat16)
        st, xb = _state(m, 1), x.bfloat16()
        got = torch.cat([m(xb[:, :8], st)] + [m(xb[:, t:t + 1], st) for t in range(8, 12)], 1)
    assert st.recurrent.dtype == torch.float32 and st.conv.dtype == torch.bfloat16
    assert got.dtype == torch.bfloat16 and rel(got.float(), want) < 3e-2


def test_bad_inputs_are_named():
    m = _layer()
    with pytest.raises(ValueError, match="hidden_size"):
        m(torch.randn(1, 3, m.hidden_size + 2))
    with pytest.raises(ValueError, match="hidden_size"):
        m(torch.randn(3, m.hidden_size))
    with pytest.raises(TypeError, match="KDAState"):
        m(torch.randn(1, 3, m.hidden_size), MLAState(1, 8, 4))
    with pytest.raises(ValueError, match="batch_size=3"):
        m(torch.randn(2, 3, m.hidden_size), _state(m, 3))
    with pytest.raises(ValueError, match="num_heads"):
        m(torch.randn(1, 3, m.hidden_size), KDAState(1, m.num_heads + 1, m.head_dim, m.conv_kernel_size))


def test_works_with_a_k3cache_entry():
    cfg = _cfg()
    torch.manual_seed(5)
    m = KimiDeltaAttention(cfg, 0)
    cache = K3Cache(cfg, 2)
    x = torch.randn(2, 6, cfg.hidden_size)
    with torch.no_grad():
        y = torch.cat([m(x[:, :4], cache.layers[0]), m(x[:, 4:5], cache.layers[0]), m(x[:, 5:], cache.layers[0])], 1)
        assert rel(y, m(x)) < 1e-5


def test_matches_transformers_kimi_linear_delta_attention():
    import transformers.models.kimi_linear.modeling_kimi_linear as tr
    from transformers import KimiLinearConfig

    m = _layer(seed=6, lower_bound=None, full_rank=False)
    hf_cfg = KimiLinearConfig(hidden_size=m.hidden_size, linear_num_heads=m.num_heads, linear_head_dim=m.head_dim,
                              linear_conv_kernel_dim=m.conv_kernel_size, rms_norm_eps=m.o_norm.eps,
                              hidden_act="silu", num_hidden_layers=4, vocab_size=32)
    ref = tr.KimiLinearDeltaAttention(hf_cfg, layer_idx=0)
    sd = m.state_dict()
    mapped = {n: t for n, t in sd.items() if not n.endswith("conv1d.weight") and n not in
              ("A_log", "dt_bias", "f_a_proj.weight", "f_b_proj.weight")}
    # transformers fuses the three depthwise convs into one conv over q|k|v channels
    mapped["conv1d.weight"] = torch.cat([sd["q_conv1d.weight"], sd["k_conv1d.weight"], sd["v_conv1d.weight"]])
    mapped["forget_gate.A_log"] = sd["A_log"].view(1, 1, -1, 1)
    mapped["forget_gate.dt_bias"] = sd["dt_bias"]
    mapped["forget_gate.f_a_proj.weight"] = sd["f_a_proj.weight"]
    mapped["forget_gate.f_b_proj.weight"] = sd["f_b_proj.weight"]
    ref.load_state_dict(mapped, strict=True)
    x = torch.randn(2, 70, m.hidden_size)
    with torch.no_grad():
        assert rel(m(x), ref(x)) < 1e-5


@pytest.mark.parametrize("lower_bound", [-5.0, None])
def test_training_forward_has_no_host_sync(lower_bound):
    # Traced with fake tensors (no values exist): a .item() would show as _local_scalar_dense and
    # a branch on a value would raise. The traced graph is then run on real values.
    from torch.func import functional_call
    from torch.fx.experimental.proxy_tensor import make_fx

    m = _layer(seed=8, lower_bound=lower_bound)
    x = torch.randn(2, 40, m.hidden_size)
    params = dict(m.named_parameters())
    gm = make_fx(lambda p, x: functional_call(m, p, (x,)), tracing_mode="fake")(params, x)
    assert not [n for n in gm.graph.nodes if "_local_scalar_dense" in str(n.target)]
    torch.testing.assert_close(gm(params, x), m(x))
