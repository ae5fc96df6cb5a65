"""KDA ops (SPEC §3.1): chunked and recurrent forms against a per-token fp64 reference written here."""

from __future__ import annotations

import math

import pytest
import torch

from k3.ops import kda
from k3.ops.kda import chunk_kda, kda_gate, l2_normalize, recurrent_kda


def reference_kda(q, k, v, g, beta, scale=None, initial_state=None):
    """SPEC §3.1 token by token in fp64: S ← diag(e^g) S; S ← S + β k (v − Sᵀk)ᵀ; o = Sᵀ(scale·q)."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    scale = K ** -0.5 if scale is None else scale
    q, k, v, g, beta = (x.double() for x in (q, k, v, g, beta))
    S = torch.zeros(B, H, K, V, dtype=torch.float64) if initial_state is None else initial_state.double()
    o = []
    for t in range(T):
        S = torch.exp(g[:, t])[..., None] * S
        pred = torch.einsum("bhkv,bhk->bhv", S, k[:, t])
        S = S + torch.einsum("bhk,bhv->bhkv", beta[:, t, :, None] * k[:, t], v[:, t] - pred)
        o.append(torch.einsum("bhkv,bhk->bhv", S, scale * q[:, t]))
    return torch.stack(o, dim=1), S


def rel_rms(a, b):
    a, b = a.double(), b.double()
    return ((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt().clamp_min(1e-30)).item()


def make_inputs(B=2, T=37, H=3, K=16, V=8, gate="bounded", A_log=0.0, init=True, seed=0,
                dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    q, k = l2_normalize(rnd(B, T, H, K)), l2_normalize(rnd(B, T, H, K))
    v = rnd(B, T, H, V)
    f = rnd(B, T, H, K)
    a, dt = torch.full((H,), float(A_log)), 0.5 * rnd(H * K)
    g = kda_gate(f, a, dt, -5.0 if gate == "bounded" else None).double()
    beta = torch.sigmoid(rnd(B, T, H))
    s0 = 0.5 * rnd(B, H, K, V) if init else None
    return tuple(x.to(dtype) if x is not None else None for x in (q, k, v, g, beta, s0))


# --- l2_normalize and kda_gate -------------------------------------------------------------------

def test_l2_normalize_matches_formula_and_keeps_dtype():
    x = torch.randn(2, 5, 3, 16, dtype=torch.float64)
    want = x / torch.sqrt(x.pow(2).sum(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(l2_normalize(x), want)
    xb = x.to(torch.bfloat16)
    out = l2_normalize(xb)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), want, atol=1e-2, rtol=1e-2)
    assert torch.all(l2_normalize(torch.zeros(4, 8)) == 0)


@pytest.mark.parametrize("lower_bound", [-5.0, None])
def test_kda_gate_matches_formula(lower_bound):
    B, T, H, D = 2, 7, 3, 4
    f = torch.randn(B, T, H, D)
    A_log = torch.randn(H)
    dt_bias = torch.randn(H * D)
    g = kda_gate(f, A_log, dt_bias, lower_bound)
    assert g.dtype == torch.float32 and g.shape == (B, T, H, D)
    want = torch.empty(B, T, H, D, dtype=torch.float64)
    for h in range(H):
        x = f[:, :, h].double() + dt_bias[h * D:(h + 1) * D].double()
        a = math.exp(A_log[h].item())
        if lower_bound is None:
            want[:, :, h] = -a * torch.log1p(torch.exp(x))
        else:
            want[:, :, h] = lower_bound / (1 + torch.exp(-a * x))
    torch.testing.assert_close(g.double(), want, atol=1e-5, rtol=1e-5)
    assert torch.all(g < 0)
    if lower_bound is not None:  # (lb, 0) in exact math; fp32 sigmoid saturates to 1, so lb is reachable
        assert torch.all(g >= lower_bound)


def test_kda_gate_bad_shapes_name_the_tensor():
    f = torch.randn(1, 2, 3, 4)
    with pytest.raises(ValueError, match="A_log"):
        kda_gate(f, torch.zeros(2), torch.zeros(12))
    with pytest.raises(ValueError, match="dt_bias"):
        kda_gate(f, torch.zeros(3), torch.zeros(4))
    with pytest.raises(ValueError, match="f must"):
        kda_gate(f[0], torch.zeros(3), torch.zeros(12))


# --- forward: chunk vs recurrent vs reference ----------------------------------------------------

@pytest.mark.parametrize("T", [1, 37, 130])
@pytest.mark.parametrize("init", [False, True])
@pytest.mark.parametrize("gate,A_log", [("bounded", 0.0), ("softplus", 2.0)])
def test_chunk_and_recurrent_match_reference(T, init, gate, A_log, path):
    q, k, v, g, beta, s0 = make_inputs(T=T, gate=gate, A_log=A_log, init=init, seed=T)
    o_ref, s_ref = reference_kda(q, k, v, g, beta, initial_state=s0)
    calls = [(chunk_kda, {}), (recurrent_kda, {})]
    if gate == "bounded":   # the factorised diagonal blocks, chosen by the caller's bound
        calls.append((chunk_kda, {"g_lower_bound": -5.0}))
    for fn, kw in calls:
        o, s = fn(q, k, v, g, beta, initial_state=s0, output_final_state=True, **kw)
        assert o.shape == v.shape and o.dtype == v.dtype
        assert s.shape == s_ref.shape and s.dtype == torch.float32
        assert rel_rms(o, o_ref) < 1e-5, (fn.__name__, kw)
        assert rel_rms(s, s_ref) < 1e-5, (fn.__name__, kw)


def _trace_with_fake_tensors(fn, *args):
    """make_fx with fake tensors (no values exist while tracing); returns (graph, host reads).

    A branch on a value (bool(tensor)) raises; a bare ``.item()`` is recorded as an
    ``aten._local_scalar_dense`` node, counted here.
    """
    from torch.fx.experimental.proxy_tensor import make_fx
    gm = make_fx(fn, tracing_mode="fake")(*args)
    reads = [n for n in gm.graph.nodes if "_local_scalar_dense" in str(n.target)]
    return gm, len(reads)


@pytest.mark.parametrize("bound", [-5.0, None])
def test_chunk_kda_picks_its_path_without_reading_tensor_values(bound):
    q, k, v, g, beta, s0 = make_inputs(T=40, dtype=torch.float32)
    fn = lambda q, k, v, g, beta, s0: chunk_kda(q, k, v, g, beta, initial_state=s0,  # noqa: E731
                                                output_final_state=True, g_lower_bound=bound)
    graph, reads = _trace_with_fake_tensors(fn, q, k, v, g, beta, s0)
    assert reads == 0
    o, s = graph(q, k, v, g, beta, s0)                         # the traced graph is the op itself
    o_ref, s_ref = reference_kda(q, k, v, g, beta, initial_state=s0)
    assert rel_rms(o, o_ref) < 1e-5 and rel_rms(s, s_ref) < 1e-5


def test_fake_tensor_tracing_rejects_a_host_sync():
    # Positive control for the test above: the same tracer refuses a function that reads a value.
    g = make_inputs(T=40, dtype=torch.float32)[3]
    assert _trace_with_fake_tensors(lambda g: g * g.abs().amax().item(), g)[1] == 1
    with pytest.raises(Exception):
        _trace_with_fake_tensors(lambda g: g * 2 if bool(g.abs().amax() < 1) else g, g)


@pytest.mark.parametrize("chunk_size", [8, 16, 24, 32, 128])
def test_chunk_size_does_not_change_the_result(chunk_size, path):
    q, k, v, g, beta, s0 = make_inputs(B=1, T=100, H=2, K=32, V=32, seed=3)
    o_ref, s_ref = reference_kda(q, k, v, g, beta, initial_state=s0)
    o, s = chunk_kda(q, k, v, g, beta, initial_state=s0, output_final_state=True, chunk_size=chunk_size)
    assert rel_rms(o, o_ref) < 1e-5
    assert rel_rms(s, s_ref) < 1e-5


def test_explicit_scale_and_no_final_state(path):
    q, k, v, g, beta, _ = make_inputs(T=20, init=False)
    o_ref, _ = reference_kda(q, k, v, g, beta, scale=0.3)
    for fn in (chunk_kda, recurrent_kda):
        o, s = fn(q, k, v, g, beta, scale=0.3)
        assert s is None
        assert rel_rms(o, o_ref) < 1e-5


def test_chunk_prefill_then_recurrent_decode_matches_whole_sequence(path):
    q, k, v, g, beta, s0 = make_inputs(T=80, seed=5)
    o_ref, s_ref = reference_kda(q, k, v, g, beta, initial_state=s0)
    o1, s1 = chunk_kda(q[:, :70], k[:, :70], v[:, :70], g[:, :70], beta[:, :70],
                       initial_state=s0, output_final_state=True)
    outs, s = [o1], s1
    for t in range(70, 80):
        sl = slice(t, t + 1)
        o_t, s = recurrent_kda(q[:, sl], k[:, sl], v[:, sl], g[:, sl], beta[:, sl],
                               initial_state=s, output_final_state=True)
        outs.append(o_t)
    assert rel_rms(torch.cat(outs, dim=1), o_ref) < 1e-5
    assert rel_rms(s, s_ref) < 1e-5


def test_bf16_inputs_give_bf16_output_and_fp32_state(path):
    q, k, v, g, beta, s0 = make_inputs(T=40, dtype=torch.bfloat16)
    o_ref, s_ref = reference_kda(q, k, v, g, beta, initial_state=s0)
    for fn in (chunk_kda, recurrent_kda):
        o, s = fn(q, k, v, g, beta, initial_state=s0, output_final_state=True)
        assert o.dtype == torch.bfloat16 and s.dtype == torch.float32
        assert rel_rms(o, o_ref) < 1e-2
        assert rel_rms(s, s_ref) < 1e-5


@pytest.mark.parametrize("A_log", [3.0, 5.0])
def test_strong_decay_softplus_gate_stays_exact_and_finite(A_log, path):
    # e^A_log · softplus(·) reaches −100s per step: decay products underflow far below fp32 range.
    q, k, v, g, beta, s0 = make_inputs(T=70, gate="softplus", A_log=A_log, seed=7)
    assert g.min() < -80
    o_ref, s_ref = reference_kda(q, k, v, g, beta, initial_state=s0)
    for fn in (chunk_kda, recurrent_kda):
        o, s = fn(q, k, v, g, beta, initial_state=s0, output_final_state=True)
        assert torch.isfinite(o).all() and torch.isfinite(s).all()
        assert rel_rms(o, o_ref) < 1e-5
        assert rel_rms(s, s_ref) < 1e-5


def test_tiny_state_decaying_into_denormal_range(path):
    # A 1e-30 state under steady decay crosses the fp32 denormal range (< 1.2e-38) mid-sequence.
    q, k, v, g, beta, s0 = make_inputs(T=64, init=True, seed=9)
    k = torch.zeros_like(k)   # no writes: the output is the decayed initial state read by q
    g = torch.full_like(g, -1.5)
    s0 = s0 * 1e-30
    o_ref, s_ref = reference_kda(q, k, v, g, beta, initial_state=s0)
    o, s = chunk_kda(q, k, v, g, beta, initial_state=s0, output_final_state=True)
    assert torch.isfinite(o).all()
    # Exact where fp32 can represent the values; flushed to ~0 below that.
    torch.testing.assert_close(o, o_ref, atol=1e-37, rtol=1e-4)
    torch.testing.assert_close(s.double(), s_ref, atol=1e-37, rtol=0)


@pytest.mark.parametrize("factor_diag", [True, False])
def test_intra_chunk_scores_match_materialised_decays(factor_diag):
    torch.manual_seed(0)
    C, K = 64, 16
    q, k = torch.randn(3, C, K), torch.randn(3, C, K)
    G = (-5.0 * torch.rand(3, C, K)).cumsum(-2)
    P, A = kda._intra_chunk_scores(q, k, G, 16, factor_diag)
    dec = torch.exp(G.unsqueeze(-2) - G.unsqueeze(-3)).double()        # [.., i, j, K]
    tril = torch.ones(C, C, dtype=torch.bool).tril()
    P_ref = (q.double().unsqueeze(-2) * k.double().unsqueeze(-3) * dec.masked_fill(~tril[..., None], 0)).sum(-1)
    A_ref = (k.double().unsqueeze(-2) * k.double().unsqueeze(-3) * dec.masked_fill(~tril.tril(-1)[..., None], 0)).sum(-1)
    torch.testing.assert_close(P.double(), P_ref, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(A.double(), A_ref, atol=1e-5, rtol=1e-4)


def test_unbounded_diagonal_blocks_survive_steep_gates():
    # Unbounded (softplus) gates as steep as -60 per token: e^{G_r - G_j} for j < r would overflow
    # fp32 in any factorisation around one row per 16-block; the halving form never builds it.
    torch.manual_seed(1)
    C, K = 64, 8
    q, k = torch.randn(2, C, K), torch.randn(2, C, K)
    G = (-60.0 * torch.rand(2, C, K)).cumsum(-2)
    P, A = kda._intra_chunk_scores(q, k, G, 16, False)
    assert torch.isfinite(P).all() and torch.isfinite(A).all()
    dec = torch.exp(G.double().unsqueeze(-2) - G.double().unsqueeze(-3)).clamp(max=1.0)
    tril = torch.ones(C, C, dtype=torch.bool).tril()
    P_ref = (q.double().unsqueeze(-2) * k.double().unsqueeze(-3) * dec.masked_fill(~tril[..., None], 0)).sum(-1)
    torch.testing.assert_close(P.double(), P_ref, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("bound", [-5.0, None])
def test_chunked_inference_forward_is_bitwise_the_training_forward(bound, monkeypatch):
    # Where the C kernels are unavailable, no_grad runs the chunked form, writing its block matrices
    # in place; the values must not move by a bit against the training forward.
    monkeypatch.setattr(kda.cpu_kernels, "unavailable", lambda: "forced off by the test")
    q, k, v, g, beta, s0 = make_inputs(T=150, dtype=torch.float32, seed=4)
    with torch.no_grad():
        o_inf, s_inf = chunk_kda(q, k, v, g, beta, initial_state=s0, output_final_state=True, g_lower_bound=bound)
    xs = [x.clone().requires_grad_(True) for x in (q, k, v, g, beta, s0)]
    o_tr, s_tr = chunk_kda(*xs[:5], initial_state=xs[5], output_final_state=True, g_lower_bound=bound)
    assert o_tr.requires_grad
    assert torch.equal(o_inf, o_tr.detach()) and torch.equal(s_inf, s_tr.detach())


def _loop64(q, k, v, g, beta, s0):
    """The rule token by token in float64 (recurrent_kda computes in fp32)."""
    B, T, H, K = q.shape
    S = torch.zeros(B, H, K, v.shape[-1], dtype=torch.float64) if s0 is None else s0.double().clone()
    q, k, v, g, beta = (x.double() for x in (q, k, v, g, beta))
    outs = []
    for t in range(T):
        S = S * g[:, t].exp()[..., None]
        u = beta[:, t, :, None] * (v[:, t] - torch.einsum("bhk,bhkv->bhv", k[:, t], S))
        S = S + k[:, t, :, :, None] * u[:, :, None, :]
        outs.append(torch.einsum("bhk,bhkv->bhv", q[:, t] * K ** -0.5, S))
    return torch.stack(outs, 1), S


@pytest.mark.parametrize("gate,A_log", [("bounded", 0.0), ("softplus", 3.0)])
def test_inference_scan_equals_the_float64_recurrence_and_the_training_forward(gate, A_log):
    # No grad on the CPU: the C recurrence (kda_scan.c). Held to the float64 per-token loop, and to
    # the chunked training forward within fp32 rounding.
    q, k, v, g, beta, s0 = make_inputs(B=2, T=150, H=3, K=64, V=48, gate=gate, A_log=A_log, seed=6)
    o64, s64 = _loop64(q, k, v, g, beta, s0)
    ref = recurrent_kda(q, k, v, g, beta, initial_state=s0)[0]      # the reference loop agrees with the module's
    torch.testing.assert_close(ref.double(), o64, atol=2e-5, rtol=1e-4)
    xs = [x.float() for x in (q, k, v, g, beta, s0)]
    with torch.no_grad():
        o, s = chunk_kda(*xs[:5], initial_state=xs[5], output_final_state=True)
    assert o.dtype == torch.float32 and s.dtype == torch.float32
    torch.testing.assert_close(o.double(), o64, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(s.double(), s64, atol=2e-5, rtol=1e-4)
    o_tr, s_tr = chunk_kda(*[x.clone().requires_grad_(True) for x in xs[:5]], initial_state=xs[5],
                           output_final_state=True)
    torch.testing.assert_close(o, o_tr.detach(), atol=2e-5, rtol=1e-4)
    with torch.no_grad():                            # no initial state, no final state
        o0, none = chunk_kda(*xs[:5])
    o0_64, _ = _loop64(q, k, v, g, beta, None)
    assert none is None
    torch.testing.assert_close(o0.double(), o0_64, atol=2e-5, rtol=1e-4)


def test_inference_scan_does_not_depend_on_how_the_sequence_is_split():
    # Prefill in pieces (the state handed on) gives the bits of one pass, and a head's output does
    # not depend on the other heads or batch rows beside it.
    q, k, v, g, beta, s0 = make_inputs(B=2, T=90, H=3, K=32, V=32, dtype=torch.float32, seed=8)
    with torch.no_grad():
        o, s = chunk_kda(q, k, v, g, beta, initial_state=s0, output_final_state=True)
        state, pieces = s0, []
        for a, b in ((0, 7), (7, 71), (71, 90)):
            oi, state = chunk_kda(q[:, a:b], k[:, a:b], v[:, a:b], g[:, a:b], beta[:, a:b],
                                  initial_state=state, output_final_state=True)
            pieces.append(oi)
        one = chunk_kda(q[1:, :, 2:], k[1:, :, 2:], v[1:, :, 2:], g[1:, :, 2:], beta[1:, :, 2:],
                        initial_state=s0[1:, 2:])[0]
    assert torch.equal(torch.cat(pieces, 1), o) and torch.equal(state, s)
    assert torch.equal(one, o[1:, :, 2:])


# --- gradients -----------------------------------------------------------------------------------

@pytest.mark.parametrize("gate,A_log", [("bounded", 0.0), ("softplus", 3.0)])
@pytest.mark.parametrize("fn", [chunk_kda, recurrent_kda])
def test_gradients_match_reference(gate, A_log, fn, path):
    inputs = make_inputs(B=2, T=45, H=2, K=16, V=12, gate=gate, A_log=A_log, seed=11)
    names = ("q", "k", "v", "g", "beta", "initial_state")
    gen = torch.Generator().manual_seed(1)
    do = torch.randn(inputs[2].shape, generator=gen, dtype=torch.float64)
    ds = torch.randn(inputs[5].shape, generator=gen, dtype=torch.float64)

    def grads(f, **kw):
        xs = [x.clone().requires_grad_(True) for x in inputs]
        o, s = f(*xs[:5], initial_state=xs[5], **kw)
        ((o.double() * do).sum() + (s.double() * ds).sum()).backward()
        return [x.grad for x in xs]

    want = grads(reference_kda)
    kw = {"output_final_state": True}
    if fn is chunk_kda:
        kw["chunk_size"] = 16
    got = grads(fn, **kw)
    for name, a, b in zip(names, got, want):
        assert torch.isfinite(a).all(), name
        assert rel_rms(a, b) < 1e-4, name


def _grads(fn, inputs, do, ds, **kw):
    xs = [x.clone().requires_grad_(True) for x in inputs]
    o, s = fn(*xs[:5], initial_state=xs[5], **kw)
    loss = (o.double() * do).sum() + ((s.double() * ds).sum() if ds is not None else 0)
    loss.backward()
    return o, [x.grad for x in xs]


@pytest.mark.parametrize("gate,A_log", [("bounded", 0.0), ("softplus", 3.0)])
@pytest.mark.parametrize("final", [True, False])
@pytest.mark.parametrize("K,V", [(64, 48), (20, 32), (24, 136)])
def test_c_backward_matches_float64_autograd_at_model_size(gate, A_log, final, K, V, path):
    # K = 64 (the presets' head size), T = 150: checkpoints at 0, 64, 128 and a 22-token tail. The C
    # kernels have vector forms for V a multiple of 16 up to 128 (V = 48; V = 32 with K = 20, rows
    # past the last full 16 summed one by one) and a scalar form for the rest (V = 136).
    inputs = make_inputs(B=2, T=150, H=2, K=K, V=V, gate=gate, A_log=A_log, seed=12)
    gen = torch.Generator().manual_seed(2)
    do = torch.randn(inputs[2].shape, generator=gen, dtype=torch.float64)
    ds = torch.randn(inputs[5].shape, generator=gen, dtype=torch.float64) if final else None
    _, want = _grads(reference_kda, inputs, do, ds)
    o, got = _grads(chunk_kda, [x.float() for x in inputs], do, ds, output_final_state=final)
    ran_c = "kda_scan" in type(o.grad_fn).__name__ or "kda_scan" in str(o.grad_fn.next_functions)
    assert ran_c == (path == "c"), o.grad_fn
    for name, a, b in zip(("q", "k", "v", "g", "beta", "initial_state"), got, want):
        assert a.dtype == torch.float32 and torch.isfinite(a).all(), name
        assert rel_rms(a, b) < 2e-5, name


def test_c_backward_does_not_depend_on_checkpoints_or_threads():
    # The backward recomputes each chunk from its checkpoint with the forward's own arithmetic, so
    # the checkpoint interval cannot change a bit; a head runs on one thread start to end.
    inputs = [x.float() for x in make_inputs(B=2, T=100, H=3, K=32, V=32, seed=13)]
    gen = torch.Generator().manual_seed(3)
    do = torch.randn(inputs[2].shape, generator=gen, dtype=torch.float64)
    ds = torch.randn(inputs[5].shape, generator=gen, dtype=torch.float64)
    threads = torch.get_num_threads()
    runs = []
    try:
        for chunk, n in ((64, 1), (7, 1), (100, 2), (1000, 2), (1, 2)):
            torch.set_num_threads(n)
            runs.append(_grads(chunk_kda, inputs, do, ds, output_final_state=True, chunk_size=chunk)[1])
    finally:
        torch.set_num_threads(threads)
    for other in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(runs[0], other))
    # Control: the chunked torch form is a different rounding of the same gradients.
    _, chunked = _grads(kda._chunked_kda, inputs, do, ds, output_final_state=True, chunk_size=64)
    assert not all(torch.equal(a, b) for a, b in zip(runs[0], chunked))
    assert all(rel_rms(a, b) < 1e-5 for a, b in zip(runs[0], chunked))


def test_c_backward_with_some_inputs_frozen():
    # Only v and g need gradients (the others are constants): the same values for those two.
    inputs = [x.float() for x in make_inputs(B=1, T=70, H=2, K=16, V=16, seed=14)]
    gen = torch.Generator().manual_seed(4)
    do = torch.randn(inputs[2].shape, generator=gen)
    _, full = _grads(chunk_kda, inputs, do, None)
    v, g = inputs[2].clone().requires_grad_(True), inputs[3].clone().requires_grad_(True)
    o, _ = chunk_kda(inputs[0], inputs[1], v, g, inputs[4], initial_state=inputs[5])
    (o * do).sum().backward()
    assert torch.equal(v.grad, full[2]) and torch.equal(g.grad, full[3])


def test_scan_op_without_checkpoints_refuses_a_backward():
    # k3::kda_scan keeps its states for the backward only when asked (ckpt_chunk > 0, what chunk_kda
    # passes under autograd); called without them directly, its backward says so.
    q, k, v, g, beta, s0 = (x.float() for x in make_inputs(T=20, seed=15))
    v = v.clone().requires_grad_(True)
    o, _, ckpt = kda._kda_scan_op(q, k, v, g, beta, s0, 0.25, 0)
    assert ckpt.numel() == 0
    with pytest.raises(RuntimeError, match="ckpt_chunk=0"):
        o.sum().backward()
    o, _, ckpt = kda._kda_scan_op(q, k, v, g, beta, s0, 0.25, 8)       # control: with checkpoints
    assert ckpt.shape == (2, 3, 3, 16, 8)
    o.sum().backward()
    assert torch.isfinite(v.grad).all() and v.grad.abs().sum() > 0


# --- bad input -----------------------------------------------------------------------------------

@pytest.mark.parametrize("fn", [chunk_kda, recurrent_kda])
@pytest.mark.parametrize("bad,match", [
    (lambda q, k, v, g, b, s: (q[0], k, v, g, b, s), "q must"),
    (lambda q, k, v, g, b, s: (q, k[:, :, :, :8], v, g, b, s), "k must"),
    (lambda q, k, v, g, b, s: (q, k, v[:, :3], g, b, s), "v must"),
    (lambda q, k, v, g, b, s: (q, k, v, g[..., :3], b, s), "g must"),
    (lambda q, k, v, g, b, s: (q, k, v, g, b[..., None], s), "beta must"),
    (lambda q, k, v, g, b, s: (q, k, v, g, b, s[:, :, :, :2]), "initial_state must"),
])
def test_bad_shapes_raise_value_error_naming_the_tensor(fn, bad, match):
    q, k, v, g, beta, s0 = bad(*make_inputs(T=5, dtype=torch.float32))
    with pytest.raises(ValueError, match=match):
        fn(q, k, v, g, beta, initial_state=s0)


def test_bad_chunk_size():
    q, k, v, g, beta, _ = make_inputs(T=5, init=False)
    with pytest.raises(ValueError, match="chunk_size"):
        chunk_kda(q, k, v, g, beta, chunk_size=0)


def test_recurrence_stays_fp32_under_bf16_autocast(path):
    # The state and its matmuls are an fp32 island: autocast must not round them to bf16.
    q, k, v, g, beta, s0 = make_inputs(T=40, dtype=torch.float32)
    for fn in (chunk_kda, recurrent_kda):
        want = fn(q, k, v, g, beta, initial_state=s0, output_final_state=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got = fn(q, k, v, g, beta, initial_state=s0, output_final_state=True)
            control = q @ k.transpose(-1, -2)    # positive control: a plain matmul is autocast
        assert control.dtype == torch.bfloat16
        assert got[0].dtype == torch.float32 and got[1].dtype == torch.float32
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), fn.__name__


