"""``k3_vec.h``'s two forms of a 16-float vector give the same bits: one AVX-512 register, or (on
targets without AVX-512) a struct of two 8-float halves, with the kernels written once over
``add16`` / ``mul16`` / ... and the pair's macros computing their left operand first so that
``-ffp-contract=fast`` fuses the same products (k3_vec.h). On an AVX-512 CPU the kernels are built
both ways (the second with ``K3_KERNEL_CFLAGS=-mno-avx512f``) and every kernel's outputs on fixed
inputs compared bit for bit (``vec_forms_outputs.py``: KDA's scan forward and backward, the packed
matmuls, the vector math, a training step's loss and gradients, decode steps). Elsewhere only the
pair form can run: the test says so in its skip."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from k3.ops import cpu_kernels

SCRIPT = Path(__file__).with_name("vec_forms_outputs.py")


def _has_avx512f() -> bool:
    return " avx512f" in cpu_kernels._cpu_flags()   # the flags line the kernels' cache key reads


def _run(tmp_path: Path, name: str, cflags: str) -> dict:
    env = {**os.environ, "K3_KERNEL_CFLAGS": cflags}
    out = tmp_path / f"{name}.pt"
    r = subprocess.run([sys.executable, str(SCRIPT), str(out)], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    return torch.load(out)


@pytest.mark.slow
def test_wide_and_pair_forms_give_the_same_bits(tmp_path):
    if not _has_avx512f():
        pytest.skip("needs an AVX-512 CPU to run both forms of k3_vec.h (this CPU has no avx512f; "
                    "it runs the pair form only)")
    wide, pair = _run(tmp_path, "wide", ""), _run(tmp_path, "pair", "-mno-avx512f")
    assert (wide["form"], pair["form"]) == ("avx512", "pair")   # two different builds ran
    assert wide["out"].keys() == pair["out"].keys() and len(wide["out"]) >= 20
    differ = [f"{name}[{i}]: max |diff| {(a - b).abs().max().item():.3g}"
              for name in wide["out"] for i, (a, b) in enumerate(zip(wide["out"][name], pair["out"][name]))
              if not torch.equal(a, b)]
    assert not differ, differ


def test_the_extra_flags_build_another_form_and_a_bad_flag_is_refused(tmp_path):
    """K3_KERNEL_CFLAGS reaches the compiler: a flag it rejects leaves the kernels unavailable with
    the compiler's message (and the model on its torch path), while the default build loads."""
    code = "from k3.ops import cpu_kernels as c; print(c.vector_form()); print(c.unavailable())"
    ok = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                        env={**os.environ, "K3_KERNEL_CFLAGS": ""})
    assert ok.returncode == 0 and ok.stdout.split("\n")[:2] == ["avx512" if _has_avx512f() else "pair", "None"]
    bad = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "K3_KERNEL_CFLAGS": "-fno-such-flag-k3",
                              "K3_KERNEL_CACHE": str(tmp_path / "kernels")})
    lines = bad.stdout.split("\n")
    assert bad.returncode == 0 and lines[0] == "None" and "-fno-such-flag-k3" in lines[1], bad.stdout + bad.stderr
