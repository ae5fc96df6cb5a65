"""The project's C kernels for the CPU decode step (and KDA prefill), built on first use here.

The sources beside this file are compiled together with ``cc -O3 -march=native -fopenmp`` into
one shared object:

* ``packed_mm.c``: matmul over packed weights;
* ``decode_rows.c``: the per-row math of a decode step, and the sampler's sort;
* ``decode_layers.c``: whole KDA, MLA and MoE sublayers made of those;
* ``kda_scan.c``: KDA's recurrence over a sequence, forward and backward (prefill, training);
* ``attn_res.c``: Block AttnRes mixing, for the decode step and for training (with its backward);
* ``short_conv.c``: KDA's short convolution with SiLU, forward and backward;
* ``k3_vec.h``, ``k3_kernels.h``: their vector helpers and entry points.

``$K3_KERNEL_CFLAGS`` (whitespace-separated) is appended to those flags: ``-mno-avx512f`` builds the
AVX2 form of ``k3_vec.h`` on an AVX-512 CPU (``vector_form()`` says which form is loaded), which is
how tests compare the two forms there.

The object lives under ``$K3_KERNEL_CACHE`` (default ``~/.cache/k3/kernels``; a temporary folder
where that cannot be written), named by a hash of the sources, the flags, the compiler's version
and the CPU's flags, and is loaded with ctypes. The OpenMP loops run on the libgomp torch has
loaded (its soname is the system's; a second runtime in the process is refused).
``unavailable()`` says why the kernels cannot run here (no compiler, a failed build); the decode
step then runs over the modules instead (``prepare_unsupported``), and ``chunk_kda`` in its
chunked form.
"""

from __future__ import annotations

import atexit
import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

__all__ = ["library", "unavailable", "kernel_path", "vector_form", "check_dense", "SOURCES", "HEADERS"]

SOURCES = tuple(Path(__file__).with_name(n)
                for n in ("packed_mm.c", "decode_rows.c", "decode_layers.c", "kda_scan.c", "attn_res.c",
                          "short_conv.c", "glu.c", "cross_entropy.c", "rms_norm.c"))
HEADERS = tuple(Path(__file__).with_name(n) for n in ("k3_vec.h", "k3_kernels.h"))
_FLAGS = ["-O3", "-march=native", "-ffp-contract=fast", "-fopenmp", "-shared", "-fPIC"]
_LOCK = threading.Lock()
_LIB: ctypes.CDLL | None = None
_WHY: str | None = None
_PATH: Path | None = None

_I64, _PTR, _INT, _F32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_float
_SIGNATURES = {
    "k3_packed_mm": [_PTR, _I64, _I64, _I64, _PTR, _I64, _PTR, _I64, _INT, _F32, _INT],
    "k3_packed_rows_mm": [_PTR, _I64, _I64, _PTR, _PTR, _I64, _I64, _PTR, _I64, _I64, _PTR, _INT],
    "k3_map": [_INT, _PTR, _I64],
    "k3_wide_registers": [],
    "k3_sort_desc": [_PTR, _I64, _I64, _PTR, _PTR, _INT],
    "k3_gated_act": [_I64, _I64, _PTR, _I64, _PTR, _I64, _INT, _F32, _INT, _PTR, _PTR, _INT],
    "k3_route": [_I64, _I64, _PTR, _I64, _PTR, _I64, _INT, _INT, _F32, _PTR, _PTR],
    "k3_attn_res_mix": [_I64, _PTR, _PTR, _I64, _I64, _PTR, _F32, _PTR],
    "k3_short_conv_silu": [_I64, _I64, _I64, _I64, _PTR, _PTR, _PTR, _PTR, _INT],
    "k3_short_conv_silu_bwd": [_I64, _I64, _I64, _I64, _PTR, _PTR, _PTR, _PTR, _PTR, _PTR, _PTR, _INT],
    "k3_cross_entropy": [_I64, _I64, _PTR, _PTR, _I64, _PTR, _PTR, _INT],
    "k3_cross_entropy_bwd": [_I64, _I64, _PTR, _PTR, _I64, _PTR, _PTR, _PTR, _INT],
    "k3_rms_norm": [_I64, _I64, _PTR, _PTR, _F32, _PTR, _PTR, _INT],
    "k3_rms_norm_bwd": [_I64, _I64, _PTR, _PTR, _PTR, _PTR, _PTR, _PTR, _INT],
    "k3_glu": [_I64, _PTR, _PTR, _INT, _F32, _F32, _PTR, _INT],
    "k3_glu_bwd": [_I64, _PTR, _PTR, _PTR, _INT, _F32, _F32, _PTR, _PTR, _INT],
    "k3_attn_res_fwd": [_I64, _PTR, _PTR, _I64, _I64, _PTR, _F32, _PTR, _PTR, _PTR, _PTR, _INT],
    "k3_attn_res_bwd": [_I64, _PTR, _PTR, _I64, _I64, _PTR, _PTR, _PTR, _PTR, _PTR, _PTR, _PTR, _INT],
    "k3_kda_layer_step": [_PTR, _I64, _PTR, _PTR, _PTR, _PTR, _PTR, _PTR, _PTR, _INT],
    "k3_moe_layer_step": [_PTR, _I64, _PTR, _PTR, _PTR, _INT],
    "k3_mla_layer_step": [_PTR, _I64, _PTR, _PTR, _PTR, _I64, _PTR, _I64, _I64, _PTR, _PTR, _PTR, _PTR, _INT],
    "k3_kda_scan": [_I64, _I64, _I64, _I64, _I64, _PTR, _PTR, _PTR, _PTR, _PTR, _F32, _PTR, _PTR, _PTR, _PTR, _I64,
                    _INT],
    "k3_kda_scan_bwd": [_I64, _I64, _I64, _I64, _I64, _PTR, _PTR, _PTR, _PTR, _PTR, _F32, _PTR, _I64, _PTR, _PTR,
                        _PTR, _PTR, _PTR, _PTR, _PTR, _PTR, _INT],
    "k3_kda_step": [_I64, _I64, _I64, _I64, _PTR, _I64, _PTR, _PTR, _PTR, _PTR, _I64, _INT, _F32, _PTR,
                    _PTR, _I64, _PTR, _I64, _PTR, _PTR, _F32, _F32, _F32, _PTR, _INT],
}


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


def _flags() -> list[str]:
    return _FLAGS + os.environ.get("K3_KERNEL_CFLAGS", "").split()


def _build() -> Path:
    cc, version = _compiler()
    flags = _flags()
    parts = [src.read_bytes() for src in SOURCES + HEADERS]
    parts += [" ".join(flags).encode(), version.encode(), _cpu_flags().encode()]
    key = hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]
    name = f"k3_cpu-{key}.so"
    try:   # the cache folder, or this process's own temporary one where it cannot be written
        d = _cache_dir()
        d.mkdir(parents=True, exist_ok=True)
        if (d / name).exists():
            return d / name
        fd, tmp = tempfile.mkstemp(dir=d, suffix=".so")
    except OSError:
        d = Path(tempfile.mkdtemp(prefix="k3-kernels-"))
        atexit.register(shutil.rmtree, d, True)   # the loaded library stays mapped; the folder goes
        fd, tmp = tempfile.mkstemp(dir=d, suffix=".so")
    path = d / name
    os.close(fd)
    try:
        out = subprocess.run([cc, *flags, "-o", tmp, *map(str, SOURCES)], capture_output=True, text=True,
                             timeout=300)
        if out.returncode != 0:
            raise OSError(f"{cc} failed: {out.stderr.strip().splitlines()[-1:]}")
        os.replace(tmp, path)   # atomic: a concurrent build leaves one whole file
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def _libgomps() -> set[str]:
    try:
        with open("/proc/self/maps") as f:
            return {line.split()[-1] for line in f if "/libgomp" in line}
    except OSError:
        return set()


def _load() -> ctypes.CDLL | None:
    global _LIB, _WHY, _PATH
    if _LIB is not None or _WHY is not None:
        return _LIB
    import torch  # noqa: F401  - torch's libgomp must be the one the kernels bind to
    with _LOCK:
        if _LIB is None and _WHY is None:
            try:
                path = _build()
                lib = ctypes.CDLL(str(path))
                gomp = _libgomps()
                if len(gomp) > 1:
                    raise OSError(f"two OpenMP runtimes in this process: {sorted(gomp)}")
                for name, argtypes in _SIGNATURES.items():
                    fn = getattr(lib, name)
                    fn.argtypes, fn.restype = argtypes, ctypes.c_int
                _LIB, _PATH = lib, path
            except (OSError, subprocess.SubprocessError, AttributeError) as e:
                _WHY = f"the CPU kernels cannot be built or loaded: {e}"
    return _LIB


def library() -> ctypes.CDLL:
    """The loaded kernels (RuntimeError with ``unavailable()``'s reason where they cannot run)."""
    lib = _load()
    if lib is None:
        raise RuntimeError(_WHY)
    return lib


def unavailable() -> str | None:
    """Why the kernels cannot run in this process (None when they can; builds them on first call)."""
    _load()
    return _WHY


def kernel_path() -> Path | None:
    """The shared object in use (None when ``unavailable()``)."""
    _load()
    return _PATH


def vector_form() -> str | None:
    """``"avx512"`` when the loaded kernels hold a 16-float vector in one register, ``"pair"`` when in
    two 8-float halves (k3_vec.h); None when ``unavailable()``."""
    lib = _load()
    return None if lib is None else ("avx512" if lib.k3_wide_registers() else "pair")


def check_dense(op: str, **tensors) -> None:
    """Each ``name=(tensor, shape)`` must be a contiguous fp32 CPU tensor of exactly that shape (the
    layout a kernel reads through its pointer); else a ValueError naming the op and the argument."""
    import torch
    for name, (t, shape) in tensors.items():
        if t.dtype != torch.float32 or t.device.type != "cpu" or tuple(t.shape) != tuple(shape) \
                or not t.is_contiguous():
            raise ValueError(f"{op}: {name}: expected a contiguous fp32 CPU tensor {list(shape)}, got "
                             f"{t.dtype} {t.device.type} {tuple(t.shape)} contiguous={t.is_contiguous()}")
