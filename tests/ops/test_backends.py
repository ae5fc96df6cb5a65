"""Op backends (``k3.ops.backend``): every op with a C kernel, on every backend this machine has,
against a float64 formula written here; ``K3_KERNELS`` obeyed (torch never touches the kernels,
auto uses them); a machine whose kernels cannot be built is told once, and ``K3_KERNELS=c`` there
is an error; a bad value names the variable."""

from __future__ import annotations

import logging
import math

import pytest
import torch

from k3.ops import backend, cpu_kernels
from k3.ops.attn_res import attn_res_mix
from k3.ops.decode_rows import sort_desc
from k3.ops.kda import chunk_kda
from k3.ops.loss import cross_entropy
from k3.ops.norm import rms_norm
from k3.ops.short_conv import short_conv_silu
from k3.ops.situ import gated_act

from test_kda import reference_kda   # the per-token fp64 recurrence (same folder)

BACKENDS = ["torch", "c"]


@pytest.fixture(params=BACKENDS)
def kernels(request, monkeypatch):
    """Runs the test under K3_KERNELS=torch, then =c (skipped, saying why, where the C kernels cannot
    exist on this machine)."""
    if request.param == "c" and cpu_kernels.unavailable() is not None:
        pytest.skip(f"no C backend here: {cpu_kernels.unavailable()}")
    monkeypatch.setenv("K3_KERNELS", request.param)
    return request.param


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _close(got: torch.Tensor, want: torch.Tensor, tol: float = 2e-6) -> None:
    scale = want.abs().max().item() or 1.0
    err = (got.double() - want).abs().max().item()
    assert err <= tol * scale, f"max error {err:.3g} at scale {scale:.3g}"


# --------------------------------------------------------------------- float64 formulas
def ref_rms_norm(x, w, eps):
    x = x.double()
    return w.double() * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def ref_situ(g, u, beta, lin):
    g, u = g.double(), u.double()
    return beta * torch.tanh(g / beta) * torch.sigmoid(g) * lin * torch.tanh(u / lin)


def ref_mix(srcs, w, gamma, eps):
    v = torch.stack([s.double() for s in srcs])
    keys = gamma.double() * v / torch.sqrt(v.pow(2).mean(-1, keepdim=True) + eps)
    alpha = torch.softmax(keys @ w.double(), 0)
    return (alpha[..., None] * v).sum(0)


def ref_ce(z, y):
    z = z.double()
    return (torch.logsumexp(z, -1) - z.gather(1, y[:, None])[:, 0]).mean()


def ref_short_conv(x, w):
    """y[t, c] = SiLU(Σ_j w[c, j] · x[t − (K−1) + j, c]), zeros before the sequence."""
    B, T, C = x.shape
    K = w.shape[1]
    xp = torch.cat([torch.zeros(B, K - 1, C, dtype=torch.float64), x.double()], 1)
    y = sum(w.double()[:, j] * xp[:, j: j + T] for j in range(K))
    return y * torch.sigmoid(y)


# --------------------------------------------------------------------- each op, each backend
def test_rms_norm(kernels):
    x, w = torch.randn(5, 7, 64, generator=_gen(0)), torch.rand(64, generator=_gen(1)) + 0.5
    _close(rms_norm(x, w, 1e-5), ref_rms_norm(x, w, 1e-5))


def test_gated_act_situ(kernels):
    g, u = torch.randn(6, 96, generator=_gen(2)) * 3, torch.randn(6, 96, generator=_gen(3)) * 3
    _close(gated_act(g, u, silu=False, beta=4.0, linear_beta=25.0), ref_situ(g, u, 4.0, 25.0))


def test_attn_res_mix(kernels):
    srcs = [torch.randn(3, 4, 64, generator=_gen(10 + i)) * (i + 1) for i in range(4)]
    w, gamma = torch.randn(64, generator=_gen(5)), torch.rand(64, generator=_gen(6)) + 0.5
    _close(attn_res_mix(srcs, w, gamma, 1e-5), ref_mix(srcs, w, gamma, 1e-5))


def test_cross_entropy(kernels):
    z, y = torch.randn(9, 300, generator=_gen(7)) * 4, torch.randint(0, 300, (9,), generator=_gen(8))
    _close(cross_entropy(z, y), ref_ce(z, y))


def test_short_conv_silu(kernels):
    x, w = torch.randn(2, 11, 24, generator=_gen(9)), torch.randn(24, 4, generator=_gen(10)) * 0.5
    _close(short_conv_silu(x, w), ref_short_conv(x, w))


def test_chunk_kda(kernels):
    B, T, H, K, V = 1, 37, 2, 16, 16
    q, k = torch.randn(B, T, H, K, generator=_gen(11)), torch.randn(B, T, H, K, generator=_gen(12))
    q, k = q / q.norm(dim=-1, keepdim=True), k / k.norm(dim=-1, keepdim=True)
    v = torch.randn(B, T, H, V, generator=_gen(13))
    g = -torch.rand(B, T, H, K, generator=_gen(14)) * 0.5
    beta = torch.rand(B, T, H, generator=_gen(15))
    o, S = chunk_kda(q, k, v, g, beta, output_final_state=True)
    o_ref, S_ref = reference_kda(q, k, v, g, beta)
    _close(o, o_ref, 1e-5), _close(S, S_ref, 1e-5)


def test_sort_desc(kernels):
    z = torch.randn(3, 500, generator=_gen(16))
    z[0, :50] = 1.5                                        # ties: the lower index first
    got = sort_desc(z)
    want = z.double().sort(dim=-1, descending=True, stable=True)
    assert torch.equal(got.values.double(), want.values) and torch.equal(got.indices, want.indices)


# --------------------------------------------------------------------- the switch itself
def _spy(monkeypatch) -> list[str]:
    """Every use of the C library is recorded (and then allowed)."""
    calls: list[str] = []
    real = cpu_kernels.library

    def library():
        calls.append("library")
        return real()
    monkeypatch.setattr(cpu_kernels, "library", library)
    return calls


def _each_op():
    x = torch.randn(4, 64, generator=_gen(20))
    rms_norm(x, torch.ones(64), 1e-5)
    gated_act(x, x, silu=True)
    attn_res_mix([x, 2 * x], torch.randn(64, generator=_gen(21)), torch.ones(64))
    cross_entropy(x, torch.tensor([1, 2, 3, 4]))
    short_conv_silu(x[None], torch.randn(64, 4, generator=_gen(22)))
    sort_desc(x)


def test_torch_mode_never_touches_the_kernels_and_auto_does(monkeypatch):
    calls = _spy(monkeypatch)
    monkeypatch.setenv("K3_KERNELS", "torch")
    _each_op()
    assert calls == []
    assert backend.c_unavailable() == "K3_KERNELS=torch"
    if cpu_kernels.unavailable() is not None:
        pytest.skip(f"the control needs the C kernels: {cpu_kernels.unavailable()}")
    monkeypatch.setenv("K3_KERNELS", "auto")                  # the control: the same calls use them
    _each_op()
    assert len(calls) >= 6 and backend.c_unavailable() is None


def test_a_machine_without_kernels_is_told_once_and_c_mode_refuses(monkeypatch, caplog):
    why = "the CPU kernels cannot be built or loaded: cc failed (simulated)"
    monkeypatch.setattr(cpu_kernels, "unavailable", lambda: why)
    monkeypatch.setattr(backend, "_noticed", type(backend._noticed)())     # a fresh process's state
    calls = _spy(monkeypatch)
    monkeypatch.delenv("K3_KERNELS", raising=False)
    x = torch.randn(4, 64, generator=_gen(23))
    with caplog.at_level(logging.WARNING, logger="k3.kernels"):
        want = ref_rms_norm(x, torch.ones(64), 1e-5)
        _close(rms_norm(x, torch.ones(64), 1e-5), want)       # still right, on torch
        _close(rms_norm(x, torch.ones(64), 1e-5), want)
        _each_op()
    notes = [r.getMessage() for r in caplog.records if r.name == "k3.kernels"]
    assert len(notes) == 1 and "cc failed (simulated)" in notes[0]
    assert calls == []
    assert backend.c_unavailable() == why
    monkeypatch.setenv("K3_KERNELS", "c")
    with pytest.raises(RuntimeError, match=r"rms_norm: K3_KERNELS=c, but .*cc failed"):
        rms_norm(x, torch.ones(64), 1e-5)
    # a call the kernel could never take (fp64) runs on torch even under c: nothing was asked of C
    _close(rms_norm(x.double(), torch.ones(64, dtype=torch.float64), 1e-5), want)


def test_a_kernels_machine_gives_no_notice(monkeypatch, caplog):
    if cpu_kernels.unavailable() is not None:
        pytest.skip(f"needs the C kernels: {cpu_kernels.unavailable()}")
    monkeypatch.setattr(backend, "_noticed", type(backend._noticed)())
    monkeypatch.delenv("K3_KERNELS", raising=False)
    with caplog.at_level(logging.WARNING, logger="k3.kernels"):
        _each_op()
    assert not [r for r in caplog.records if r.name == "k3.kernels"]


@pytest.mark.parametrize("value", ["C", "cuda", "fast", " auto"])
def test_a_bad_k3_kernels_value_is_named(monkeypatch, value):
    monkeypatch.setenv("K3_KERNELS", value)
    with pytest.raises(ValueError, match=f"K3_KERNELS={value!r}: expected one of auto, torch, c"):
        rms_norm(torch.randn(2, 8), torch.ones(8), 1e-5)
    for ok in ("auto", ""):                                    # control (empty: the default)
        monkeypatch.setenv("K3_KERNELS", ok)
        assert math.isfinite(float(rms_norm(torch.randn(2, 8), torch.ones(8), 1e-5).sum()))
