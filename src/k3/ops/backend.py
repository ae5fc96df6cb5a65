"""Which implementation runs an op: its torch formulation or the project's C kernel.

Every op with a C kernel (``rms_norm``, ``gated_act``, ``attn_res_mix``, ``cross_entropy``,
``short_conv_silu``, ``chunk_kda``, ``sort_desc``, and the prepared decode step) asks
``use_c(op, fits)`` on each call. ``fits`` is the op's own test of this call (fp32 tensors on the
CPU, sizes the kernel takes); ``K3_KERNELS`` decides the rest:

* ``auto`` (default): the C kernel when the call fits and the kernels are built on this machine,
  else torch. Where they cannot be built (no compiler, a failed build), the first call that
  would have used them logs one warning naming the reason (logger ``k3.kernels``), then every op
  runs on torch;
* ``torch``: always the torch formulation (the reference the kernels are tested against);
* ``c``: as ``auto``, except that kernels which cannot be built here are an error naming why.

CUDA tensors never fit a C kernel; ``chunk_kda`` takes fla's kernel there when fla is installed
(``k3.ops.kda``). The torch formulation of each op sits beside its dispatch in the op's module, and
``tests/ops/test_backends.py`` runs every backend this machine has against a float64 reference,
skipping (with the reason) one that cannot exist here.
"""

from __future__ import annotations

import logging
import os
import threading

from k3.ops import cpu_kernels

__all__ = ["MODES", "mode", "use_c", "c_unavailable"]

MODES = ("auto", "torch", "c")
log = logging.getLogger("k3.kernels")
_noticed = threading.Event()


def mode() -> str:
    """``K3_KERNELS`` (unset or empty: ``auto``); another value is a ValueError naming the variable."""
    value = os.environ.get("K3_KERNELS") or "auto"
    if value not in MODES:
        raise ValueError(f"K3_KERNELS={value!r}: expected one of {', '.join(MODES)}")
    return value


def c_unavailable() -> str | None:
    """Why C kernels do not run in this process (``K3_KERNELS=torch``, or why they cannot be built);
    None when they do."""
    if mode() == "torch":
        return "K3_KERNELS=torch"
    return cpu_kernels.unavailable()


def use_c(op: str, fits: bool) -> bool:
    """True when this call of ``op`` runs its C kernel (module docstring)."""
    if not fits or mode() == "torch":
        return False
    why = cpu_kernels.unavailable()
    if why is None:
        return True
    if mode() == "c":
        raise RuntimeError(f"{op}: K3_KERNELS=c, but {why}")
    if not _noticed.is_set():
        _noticed.set()
        log.warning("k3: %s; ops run on torch (K3_KERNELS=torch says so without building them)", why)
    return False
