"""fp32 matmul over panel-packed weights for decode-sized batches (the C kernel beside this file).

A decode step multiplies a few rows (1 to a few dozen) by each weight, so it is bound by reading
the weights. MKL's sgemm streams them well for one row but about half as fast from 4 rows on, and
the MoE's per-expert products cost one dispatch each. ``PackedMatrix`` stores ``W [K, N]`` (or a
stack ``[E, K, N]``) as column panels and multiplies with one kernel call:

* ``mm(x, res)``: ``res + x @ W`` (``res`` may be a row ``[N]``, broadcast);
* ``rows_mm(x, rows, experts)``: slot ``s`` gets ``x[rows[s]] @ W[experts[s]]`` (the routed experts
  of all tokens in one call).

Each output element is one FMA chain over ``k`` in order, so a row's result never depends on the
other rows of the batch. The kernel is compiled on first use for this machine (``cc -O3
-march=native -fopenmp``) into ``$K3_KERNEL_CACHE`` (default ``~/.cache/k3/kernels``), keyed by the
source, the flags, the compiler and the CPU; ``unavailable()`` says why it cannot be used here (no
compiler, a failed build), and the decode step then runs over the modules instead.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

__all__ = ["NR", "PackedMatrix", "unavailable", "kernel_path"]

NR = 32   # panel width (columns), as in packed_mm.c
_SRC = Path(__file__).with_name("packed_mm.c")
_FLAGS = ["-O3", "-march=native", "-ffp-contract=fast", "-fopenmp", "-shared", "-fPIC"]
_LOCK = threading.Lock()
_LIB: ctypes.CDLL | None = None
_WHY: str | None = None
_PATH: Path | None = None


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return ""


def _cache_dir() -> Path:
    env = os.environ.get("K3_KERNEL_CACHE")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "k3" / "kernels"


def _compiler() -> tuple[str, str]:
    cc = os.environ.get("CC", "cc")
    out = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30)
    if out.returncode != 0:
        raise OSError(f"{cc} --version exited {out.returncode}")
    return cc, out.stdout


def _build() -> Path:
    cc, version = _compiler()
    src = _SRC.read_bytes()
    key = hashlib.sha256(b"\0".join([src, " ".join(_FLAGS).encode(), version.encode(),
                                     _cpu_flags().encode()])).hexdigest()[:16]
    try:
        d = _cache_dir()
        d.mkdir(parents=True, exist_ok=True)
    except OSError:
        d = Path(tempfile.mkdtemp(prefix="k3-kernels-"))
    path = d / f"packed_mm-{key}.so"
    if path.exists():
        return path
    fd, tmp = tempfile.mkstemp(dir=d, suffix=".so")
    os.close(fd)
    try:
        out = subprocess.run([cc, *_FLAGS, "-o", tmp, str(_SRC)], capture_output=True, text=True, timeout=300)
        if out.returncode != 0:
            raise OSError(f"{cc} failed on {_SRC.name}: {out.stderr.strip().splitlines()[-1:]}")
        os.replace(tmp, path)   # atomic: a concurrent build leaves one whole file
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def _load() -> ctypes.CDLL | None:
    global _LIB, _WHY, _PATH
    if _LIB is not None or _WHY is not None:
        return _LIB
    with _LOCK:
        if _LIB is None and _WHY is None:
            try:
                path = _build()
                lib = ctypes.CDLL(str(path))
                gomp = _libgomps()
                if len(gomp) > 1:
                    raise OSError(f"two OpenMP runtimes in this process: {sorted(gomp)}")
                i64, ptr = ctypes.c_int64, ctypes.c_void_p
                lib.k3_packed_mm.argtypes = [ptr, i64, i64, i64, ptr, i64, ptr, i64, ctypes.c_int, ctypes.c_int]
                lib.k3_packed_rows_mm.argtypes = [ptr, i64, i64, ptr, ptr, i64, i64, ptr, i64, i64, ptr,
                                                  ctypes.c_int]
                _LIB, _PATH = lib, path
            except (OSError, subprocess.SubprocessError) as e:
                _WHY = f"the packed matmul kernel cannot be built or loaded: {e}"
    return _LIB


def _libgomps() -> set[str]:
    try:
        with open("/proc/self/maps") as f:
            return {line.split()[-1] for line in f if "/libgomp" in line}
    except OSError:
        return set()


def unavailable() -> str | None:
    """Why the kernel cannot run in this process (None when it can; builds it on first call)."""
    _load()
    return _WHY


def kernel_path() -> Path | None:
    """The shared object in use (None when ``unavailable()``)."""
    _load()
    return _PATH


def _check_rows(x: torch.Tensor, K: int, what: str) -> None:
    if x.dtype != torch.float32 or x.device.type != "cpu" or x.dim() != 2 or x.shape[1] != K or \
            (x.stride(1) != 1 and x.shape[1] > 1):
        raise ValueError(f"{what}: expected fp32 CPU rows [M, {K}] with unit column stride, got "
                         f"{x.dtype} {x.device.type} {tuple(x.shape)} strides {x.stride()}")


class PackedMatrix:
    """``w [K, N]`` or ``[E, K, N]`` (fp32, any strides) copied into panels ``[E, ceil(N/NR), K, NR]``."""

    __slots__ = ("E", "K", "N", "data")

    def __init__(self, w: torch.Tensor):
        if _load() is None:
            raise RuntimeError(_WHY)
        if w.dtype != torch.float32 or w.dim() not in (2, 3):
            raise ValueError(f"PackedMatrix: expected fp32 [K, N] or [E, K, N], got {w.dtype} {tuple(w.shape)}")
        w = w.detach().reshape(-1, *w.shape[-2:])
        E, K, N = w.shape
        np_ = -(-N // NR)
        data = torch.zeros(E, K, np_ * NR)
        data[:, :, :N] = w
        self.E, self.K, self.N = E, K, N
        self.data = data.view(E, K, np_, NR).permute(0, 2, 1, 3).contiguous()

    def unpacked(self) -> torch.Tensor:
        """The matrix back as ``[E, K, N]`` (a copy; for tests and inspection)."""
        E, np_, K, _ = self.data.shape
        return self.data.permute(0, 2, 1, 3).reshape(E, K, np_ * NR)[:, :, :self.N].contiguous()

    def mm(self, x: torch.Tensor, res: torch.Tensor | None = None) -> torch.Tensor:
        """``x @ W`` (``res + x @ W`` when given: ``[M, N]`` or a row ``[N]``); a single matrix only."""
        if self.E != 1:
            raise ValueError(f"PackedMatrix.mm: this is a stack of {self.E} matrices; use rows_mm")
        _check_rows(x, self.K, "PackedMatrix.mm")
        M = x.shape[0]
        y = torch.empty(M, self.N)
        if res is not None:
            y.copy_(res)
        rc = _LIB.k3_packed_mm(x.data_ptr(), x.stride(0), M, self.K, self.data.data_ptr(), self.N,
                               y.data_ptr(), self.N, int(res is not None), torch.get_num_threads())
        if rc:
            raise MemoryError("PackedMatrix.mm: no memory for the kernel's work lists")
        return y

    def rows_mm(self, x: torch.Tensor, rows: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """``[S, N]``: slot ``s`` is ``x[rows[s]] @ W[experts[s]]`` (``rows``, ``experts``: int64 ``[S]``)."""
        _check_rows(x, self.K, "PackedMatrix.rows_mm")
        rows, experts = rows.reshape(-1), experts.reshape(-1)
        if rows.dtype != torch.int64 or experts.dtype != torch.int64 or rows.shape != experts.shape:
            raise ValueError(f"PackedMatrix.rows_mm: rows and experts must be int64 of one length, got "
                             f"{rows.dtype} {tuple(rows.shape)} and {experts.dtype} {tuple(experts.shape)}")
        rows, experts = rows.contiguous(), experts.contiguous()
        S = rows.shape[0]
        y = torch.empty(S, self.N)
        rc = _LIB.k3_packed_rows_mm(x.data_ptr(), x.stride(0), x.shape[0], rows.data_ptr(), experts.data_ptr(),
                                    S, self.K, self.data.data_ptr(), self.N, self.E, y.data_ptr(),
                                    torch.get_num_threads())
        if rc == 1:
            raise IndexError(f"PackedMatrix.rows_mm: a row index is outside [0, {x.shape[0]})")
        if rc == 2:
            raise IndexError(f"PackedMatrix.rows_mm: an expert index is outside [0, {self.E})")
        if rc:
            raise MemoryError("PackedMatrix.rows_mm: no memory for the kernel's work lists")
        return y
