"""The packed matmul kernel (``k3.ops.packed_mm``) against float64 matmuls and per-slot loops: every
row count around the 8-row tile, widths that are not a whole panel, strided rows, a residual or a
broadcast bias; results independent of the batch and of the thread count (bitwise); the routed
form with repeated, missing and out-of-range indices; and the build's failure reported (with the
decode step falling back to the modules) when the compiler is missing."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from k3.ops import cpu_kernels
from k3.ops.packed_mm import NR, PackedMatrix


def _g(seed):
    return torch.Generator().manual_seed(seed)


def _close64(got, want64, tol=2e-6):
    """got (fp32) within tol of the float64 result's scale."""
    err = (got.double() - want64).abs().max() / want64.abs().max().clamp_min(1e-30)
    assert err <= tol, float(err)


def test_the_kernel_builds_here_and_shares_torchs_openmp():
    assert cpu_kernels.unavailable() is None
    assert cpu_kernels.kernel_path().is_file()
    gomp = {line.split()[-1] for line in open("/proc/self/maps") if "/libgomp" in line}
    assert len(gomp) == 1 and "torch" in next(iter(gomp))


@pytest.mark.parametrize("K,N", [(64, 2 * NR), (33, 65), (256, 100), (7, 1)])
@pytest.mark.parametrize("M", [1, 2, 3, 4, 7, 8, 9, 12, 17, 40])   # 1-2 rows: 4 panels a tile, 3-4: 2
def test_mm_equals_the_float64_product(K, N, M):
    w = torch.randn(K, N, generator=_g(K + N))
    x = torch.randn(M, K, generator=_g(M))
    P = PackedMatrix(w)
    assert torch.equal(P.unpacked()[0], w)
    want = x.double() @ w.double()
    _close64(P.mm(x), want)
    res = torch.randn(M, N, generator=_g(3))
    _close64(P.mm(x, res), want + res.double())
    bias = torch.randn(N, generator=_g(4))
    _close64(P.mm(x, bias), want + bias.double())


def test_mm_reads_strided_rows_and_transposed_weights():
    """x a column slice of a wider tensor (row stride > K); W given as a transposed view."""
    big = torch.randn(5, 300, generator=_g(0))
    x = big[:, 37:37 + 128]
    wt = torch.randn(70, 128, generator=_g(1))
    P = PackedMatrix(wt.t())
    _close64(P.mm(x), x.double() @ wt.t().double())
    assert torch.equal(P.mm(x), P.mm(x.contiguous()))


def test_a_rows_result_does_not_depend_on_its_batch_or_the_thread_count():
    w = torch.randn(512, 300, generator=_g(0))
    x = torch.randn(19, 512, generator=_g(1))
    P = PackedMatrix(w)
    batch = P.mm(x)
    alone = torch.cat([P.mm(x[i:i + 1]) for i in range(19)])
    assert torch.equal(batch, alone)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = P.mm(x)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(batch, one)
    # the control: the same rows through torch's matmul are not all bitwise equal to the kernel's,
    # so the equalities above are not those of one shared library call
    assert not torch.equal(batch, x @ w)


def _rows_reference(x, w, rows, experts):
    return torch.stack([x[r].double() @ w[e].double() for r, e in zip(rows.tolist(), experts.tolist())])


@pytest.mark.parametrize("S", [1, 5, 8, 9, 30, 60])   # 60: ~20 slots an expert, past a 16-row chunk
def test_rows_mm_equals_a_per_slot_loop(S):
    E, K, N, R = 6, 96, 80, 7
    w = torch.randn(E, K, N, generator=_g(S))
    x = torch.randn(R, K, generator=_g(S + 1))
    rows = torch.randint(0, R, (S,), generator=_g(S + 2))
    experts = torch.randint(0, 3, (S,), generator=_g(S + 3)) * 2   # experts 1, 3, 5 never used
    P = PackedMatrix(w)
    got = P.rows_mm(x, rows, experts)
    assert got.shape == (S, N)
    _close64(got, _rows_reference(x, w, rows, experts))
    # each slot equals the single-matrix kernel on its own expert (the same FMA chain)
    for s in range(S):
        one = PackedMatrix(w[experts[s]])
        assert torch.equal(got[s:s + 1], one.mm(x[rows[s]:rows[s] + 1]))


def test_rows_mm_refuses_bad_indices_and_shapes():
    P = PackedMatrix(torch.randn(4, 16, 8))
    x = torch.randn(3, 16)
    ok = P.rows_mm(x, torch.tensor([0, 2]), torch.tensor([3, 0]))     # the control: valid indices work
    _close64(ok, _rows_reference(x, P.unpacked(), torch.tensor([0, 2]), torch.tensor([3, 0])))
    with pytest.raises(IndexError, match=r"row index is outside \[0, 3\)"):
        P.rows_mm(x, torch.tensor([0, 3]), torch.tensor([3, 0]))
    with pytest.raises(IndexError, match=r"expert index is outside \[0, 4\)"):
        P.rows_mm(x, torch.tensor([0, 1]), torch.tensor([4, 0]))
    with pytest.raises(IndexError, match="expert index"):
        P.rows_mm(x, torch.tensor([0]), torch.tensor([-1]))
    with pytest.raises(ValueError, match="int64 of one length"):
        P.rows_mm(x, torch.tensor([0, 1]), torch.tensor([0]))
    with pytest.raises(ValueError, match=r"expected fp32 CPU rows \[M, 16\]"):
        P.rows_mm(torch.randn(3, 15), torch.tensor([0]), torch.tensor([0]))
    with pytest.raises(ValueError, match="use rows_mm"):
        P.mm(x)
    assert P.rows_mm(x, torch.tensor([], dtype=torch.long), torch.tensor([], dtype=torch.long)).shape == (0, 8)


def test_an_empty_matrix_is_refused_by_name():
    assert PackedMatrix(torch.randn(1, 1)).mm(torch.ones(2, 1)).shape == (2, 1)    # the control: 1 x 1 packs
    for shape in ((0, 5), (5, 0), (0, 3, 4)):
        with pytest.raises(ValueError, match="no empty dimension"):
            PackedMatrix(torch.zeros(shape))


def test_mm_refuses_wrong_rows():
    P = PackedMatrix(torch.randn(16, 8))
    with pytest.raises(ValueError, match=r"\[M, 16\]"):
        P.mm(torch.randn(2, 17))
    with pytest.raises(ValueError, match="fp32"):
        P.mm(torch.randn(2, 16, dtype=torch.float64))
    with pytest.raises(ValueError, match="unit column stride"):
        P.mm(torch.randn(16, 2).t())
    with pytest.raises(ValueError, match="fp32"):
        PackedMatrix(torch.randn(16, 8, dtype=torch.float64))


_NO_CC = textwrap.dedent("""
    import torch
    from k3.config import get_preset
    from k3.infer.prepared import PreparedWeights, prepare_unsupported
    from k3.model.decoder import K3ForCausalLM
    from k3.ops import cpu_kernels
    torch.manual_seed(0)
    model = K3ForCausalLM(get_preset("nano")).eval()
    print("WHY", cpu_kernels.unavailable())
    print("PATH", cpu_kernels.kernel_path())
    print("PREP", prepare_unsupported(model))
    weights = PreparedWeights(model)
    with torch.no_grad():
        c1, c2 = model.new_cache(1), model.new_cache(1)
        prompt = torch.tensor([[3, 1, 4, 1, 5]])
        model(prompt, cache=c1), model(prompt, cache=c2)
        tok = torch.tensor([[9]])
        plan = weights.current()
        got = model(tok, cache=c1, prepared=plan).logits[:, -1]
        want = model(tok, cache=c2).logits[:, -1]
    print("PLAN", plan is None, "CLOSE", bool((got - want).abs().max() <= 1e-5 * want.abs().max()))
""")


@pytest.mark.parametrize("cc", ["/bin/false", None])   # None: the machine's compiler (the control)
def test_a_missing_compiler_is_reported_and_decode_runs_over_the_modules(tmp_path, cc):
    env = {**os.environ, "K3_KERNEL_CACHE": str(tmp_path / "kernels")}
    if cc is not None:
        env["CC"] = cc
    out = subprocess.run([sys.executable, "-c", _NO_CC], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = dict(line.split(" ", 1) for line in out.stdout.splitlines() if line[:3] in ("WHY", "PRE", "PLA", "PAT"))
    if cc is None:
        assert lines["WHY"] == "None" and lines["PREP"] == "None"
        assert lines["PLAN"] == "False CLOSE True"           # the prepared step ran, and is right
        assert len(list((tmp_path / "kernels").glob("k3_cpu-*.so"))) == 1
    else:
        assert "cannot be built or loaded" in lines["WHY"] and "/bin/false" in lines["WHY"]
        assert lines["PREP"] == lines["WHY"]
        assert lines["PLAN"] == "True CLOSE True"            # the modules' step ran, and is right


def test_a_cache_folder_that_cannot_be_made_falls_back_to_a_temporary_one(tmp_path):
    """K3_KERNEL_CACHE below a regular file: the build goes to a temporary folder, which still serves
    and is removed when the process ends."""
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    env = {**os.environ, "K3_KERNEL_CACHE": str(blocker / "kernels")}
    out = subprocess.run([sys.executable, "-c", _NO_CC], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = dict(line.split(" ", 1) for line in out.stdout.splitlines() if line[:3] in ("WHY", "PLA", "PAT"))
    assert lines["WHY"] == "None" and lines["PLAN"] == "False CLOSE True"
    assert "k3-kernels-" in lines["PATH"] and str(blocker) not in lines["PATH"]
    assert not os.path.exists(os.path.dirname(lines["PATH"]))      # removed when the process ended
