"""benchmarks/gpu_check.py (``make gpu-check``, docs/GPU.md) on a CPU-only machine: every CUDA check and
benchmark is one SKIP line naming why, the JSON lines parse and carry machine / date / status, and the
exit status is 0; the same parts run on the CPU against the CPU (``--device cpu``: the script's own
plumbing: the KDA comparisons, the bf16 step, the engine, the torchrun launch on gloo, the timings) pass;
and the comparison can fail: mismatched tensors, a NaN, a wrong shape, a wrong kernel result, a part
that raises or overruns its time limit each give FAIL, never PASS."""

from __future__ import annotations

import datetime
import importlib.util
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "gpu_check.py"


@pytest.fixture(scope="module")
def gc():
    """The script imported by path (``benchmarks`` is no package); importing it changes no environment."""
    before = dict(os.environ)
    spec = importlib.util.spec_from_file_location("gpu_check_under_test", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod   # its dataclass looks its module up while the class is made
    try:
        spec.loader.exec_module(mod)
        assert dict(os.environ) == before
        yield mod
    finally:
        sys.modules.pop(spec.name, None)


def _metrics(gc) -> list[str]:
    return [m for _, metrics, _, _ in gc.PARTS for m in metrics]


def _run(out: Path, *extra: str, timeout: int = 150, **env_extra: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("K3_KERNELS", "TRITON_F32_DEFAULT")}
    env.update(env_extra)
    return subprocess.run([sys.executable, str(SCRIPT), "--quick", "--out", str(out), *extra], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=timeout)


def _strict(line: str) -> dict:
    """One JSON line, refusing NaN / Infinity (not JSON)."""
    def refuse(name):
        raise ValueError(f"non-standard JSON constant {name}")
    return json.loads(line, parse_constant=refuse)


def _rows(out: Path) -> list[dict]:
    return [_strict(line) for line in (out / "gpu_check.jsonl").read_text().splitlines()]


def _check_row_fields(row: dict) -> None:
    assert row["bench"] == "gpu_check"
    assert row["status"] in ("PASS", "FAIL", "SKIP")
    assert isinstance(row["machine"], str) and row["machine"]
    datetime.date.fromisoformat(row["date"])
    assert isinstance(row["detail"], str) and row["detail"]
    assert {"metric", "value", "unit"} <= row.keys()


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the parts would run, not skip")
def test_cpu_run_skips_every_cuda_part_and_exits_0(gc, tmp_path):
    p = _run(tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    lines = p.stdout.splitlines()
    head = lines[0]
    assert head.startswith("gpu_check: torch ") and "CUDA available: no" in head and "fla: " in head
    for m in _metrics(gc):
        skip = [ln for ln in lines if ln.startswith(f"SKIP {m}: ")]
        assert len(skip) == 1, (m, p.stdout)
        assert "no CUDA" in skip[0]
    assert not [ln for ln in lines if ln.startswith(("PASS ", "FAIL "))], p.stdout
    rows = _rows(tmp_path)
    assert [r["metric"] for r in rows] == _metrics(gc)
    for r in rows:
        _check_row_fields(r)
        assert r["status"] == "SKIP" and "no CUDA" in r["detail"]
        assert "no GPU" in r["machine"]


@pytest.mark.slow
def test_self_test_on_the_cpu_passes(gc, tmp_path):
    """--device cpu: the same code on the CPU against the CPU (one pass of every part's plumbing). With the
    C kernels on (K3_KERNELS=auto, not the script's default torch) kda_fla compares the C scan with the
    chunked form, and the engine decodes through its prepared step: quicker on 2 cores."""
    # no wall-time assertion: speed is the benchmarks' business; the timeout only guards a hang
    # (this run took 24 s on a quiet 2-core machine and past 120 s beside another CPU-bound job)
    p = _run(tmp_path, "--device", "cpu", timeout=600, K3_KERNELS="auto")
    assert p.returncode == 0, p.stdout + p.stderr[-3000:]
    rows = {r["metric"]: r for r in _rows(tmp_path)}
    assert list(rows) == _metrics(gc)
    for m, r in rows.items():
        _check_row_fields(r)
        assert r["device"] == "cpu"
        if m in ("train_mfu", "decode_tps_b1", "decode_tps_b64", "prefill_tps_64k"):
            # a timing on a shared 2-core machine may be noise, never a crash: a number was measured
            assert isinstance(r["value"], (int, float)) and math.isfinite(r["value"]), r
        else:
            assert r["status"] == "PASS", r
    assert rows["nccl_step"]["backend"] == "gloo"


def test_compare_fails_on_a_wrong_reference(gc):
    x = torch.randn(3, 50, 4, 16)
    assert gc.compare({"o": (x, x.clone())}, 1e-4)[0] == "PASS"
    assert gc.compare({"o": (x * (1 + 1e-6), x)}, 1e-4)[0] == "PASS"
    status, worst, detail = gc.compare({"o": (x, x), "state": (x * 1.01, x)}, 1e-4)
    assert status == "FAIL" and worst > 1e-3 and "state" in detail and "> 0.0001" in detail
    assert gc.compare({"o": (torch.randn_like(x), x)}, 3e-2)[0] == "FAIL"
    nan = x.clone()
    nan[0, 0, 0, 0] = float("nan")
    assert gc.compare({"o": (nan, x)}, 1e-4)[0] == "FAIL"
    assert gc.compare({"o": (x[:, :49], x)}, 1e-4)[0] == "FAIL"
    assert gc.compare({"dq": (None, x)}, 1e-4)[0] == "FAIL"
    assert gc.compare({}, 1e-4)[0] == "FAIL"
    assert gc.rel_err(torch.zeros(3), torch.zeros(3)) == 0.0


def _ctx(gc, tmp_path, budget: float = 60.0):
    rep = gc.Report(tmp_path / "gpu_check.jsonl", "test machine", "cpu")
    return gc.Ctx(torch.device("cpu"), True, tmp_path, rep, False, "not importable (test)",
                  time.monotonic() + budget)


def test_kda_check_fails_on_a_wrong_kernel_result(gc, tmp_path, monkeypatch):
    """The check's own plumbing: a chunk_kda that is 1% off is a FAIL of the checks that call it."""
    import k3.ops.kda as kda

    right = kda.chunk_kda

    def off(*args, **kwargs):
        o, s = right(*args, **kwargs)
        return o * 1.01, s

    monkeypatch.setattr(kda, "chunk_kda", off)
    ctx = _ctx(gc, tmp_path)
    gc.check_kda(ctx)
    status = {r["metric"]: r["status"] for r in ctx.rep.rows}
    assert status == {"kda_fla": "FAIL", "kda_cuda_torch": "PASS", "kda_bf16": "PASS", "kda_recurrent": "PASS"}
    assert "o 1.0e-02" in ctx.rep.rows[0]["detail"]

    def nan(*args, **kwargs):
        o, s = right(*args, **kwargs)
        return o * float("nan"), s

    monkeypatch.setattr(kda, "chunk_kda", nan)
    ctx = _ctx(gc, tmp_path / "nan")
    gc.check_kda(ctx)
    rows = {r["metric"]: r for r in _rows(tmp_path / "nan")}
    assert rows["kda_fla"]["status"] == rows["kda_bf16"]["status"] == "FAIL"
    assert rows["kda_fla"]["value"] == "inf"   # strict JSON: the non-finite error is named, not Infinity


def test_a_failing_or_overrunning_part_fails_only_its_results(gc, tmp_path):
    ctx = _ctx(gc, tmp_path)

    def half(c):
        c.rep.add("a", "PASS", "done", 1.0, "x")
        raise RuntimeError("boom\nsecond line")

    gc.run_part(ctx, ("a", "b"), half, 30, None)
    gc.run_part(ctx, ("c",), lambda c: time.sleep(5), 0.3, None)
    gc.run_part(ctx, ("d",), lambda c: None, 30, None)
    gc.run_part(ctx, ("e",), lambda c: c.rep.add("e", "PASS", "ran"), 30, "no CUDA (test)")
    ctx.deadline = time.monotonic() + 1
    gc.run_part(ctx, ("f",), lambda c: c.rep.add("f", "PASS", "ran"), 30, None)
    rows = {r["metric"]: r for r in ctx.rep.rows}
    assert rows["a"]["status"] == "PASS"
    assert rows["b"]["status"] == "FAIL" and "RuntimeError: boom second line" in rows["b"]["detail"]
    assert rows["c"]["status"] == "FAIL" and "time limit" in rows["c"]["detail"]
    assert rows["d"]["status"] == "FAIL" and "without reporting" in rows["d"]["detail"]
    assert rows["e"]["status"] == "SKIP" and rows["e"]["detail"] == "no CUDA (test)"
    assert rows["f"]["status"] == "SKIP" and "time budget" in rows["f"]["detail"]
    assert ctx.rep.failed == ["b", "c", "d"]
    assert [r["metric"] for r in _rows(tmp_path)] == list(rows)
