"""The project's C kernels for the CPU decode step (and KDA prefill), built on first use here.

The sources beside this file are compiled together with ``cc -O3 -march=native -fopenmp`` into
one shared object:

* ``packed_mm.c``: matmul over packed weights;
* ``decode_rows.c``: the per-row math of a decode step, and the sampler's sort;
* ``decode_layers.c``: whole KDA, MLA and MoE sublayers made of those;
* ``kda_scan.c``: KDA's recurrence over a sequence, forward and backward (prefill, training);
* ``attn_res.c``: Block AttnRes mixing, for the decode step and for training (with its backward);
* ``short_conv.c``: KDA's short convolution with SiLU, forward and backward;
* ``k3_vec.h``, ``k3_kernels.h``: their vector helpers, and the prototype of every entry point with
  the structs they take (each .c file includes it, so the compiler checks the definitions).

At load, ``k3_kernels.h`` is read (``parse_header``) and each function it declares gets its ctypes
argument types from its prototype (``signatures()``); a prototype the parser cannot read, a declared
function the library lacks, or a ctypes struct of ``k3.ops.kernel_structs`` laid out otherwise than
its C struct makes the kernels unavailable, the reason naming it. ``$K3_KERNEL_HEADER`` names
another header to read instead (for tests; the build always uses the one beside the sources).

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
import re
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

from k3.ops.kernel_structs import check_layouts

__all__ = ["library", "unavailable", "kernel_path", "vector_form", "check_dense", "signatures", "parse_header",
           "HeaderError", "SOURCES", "HEADERS"]

SOURCES = tuple(Path(__file__).with_name(n)
                for n in ("packed_mm.c", "decode_rows.c", "decode_layers.c", "kda_scan.c", "attn_res.c",
                          "short_conv.c", "glu.c", "cross_entropy.c", "rms_norm.c"))
HEADERS = tuple(Path(__file__).with_name(n) for n in ("k3_vec.h", "k3_kernels.h"))
_FLAGS = ["-O3", "-march=native", "-ffp-contract=fast", "-fopenmp", "-shared", "-fPIC"]
_LOCK = threading.Lock()
_LIB: ctypes.CDLL | None = None
_WHY: str | None = None
_PATH: Path | None = None

_TYPES = {"int": ctypes.c_int, "int64_t": ctypes.c_int64, "float": ctypes.c_float}
_COMMENT = re.compile(r"/\*.*?\*/|//[^\n]*", re.S)
_TYPEDEF = re.compile(r"typedef\s+struct\s*\{[^{}]*\}\s*([A-Za-z_]\w*)\s*;")
_TOKEN = re.compile(r"[A-Za-z_]\w*|\S")
_PROTO = re.compile(r"int ([A-Za-z_]\w*) \((.*)\)")
_PARAM = re.compile(r"(?:const )?([A-Za-z_]\w*)((?: \*(?: const)?)*)(?: ([A-Za-z_]\w*))?")


class HeaderError(ValueError):
    """A declaration of the kernels' header that ``parse_header`` cannot read."""


def _param(text: str, structs: set[str]):
    m = _PARAM.fullmatch(text)
    if m is None:
        raise ValueError(f"cannot read parameter {text!r}")
    base, stars, name = m.groups()
    if base not in _TYPES and base not in structs and base != "void":
        raise ValueError(f"unknown type {base!r} in parameter {text!r}")
    if name in _TYPES or name in structs or name in ("void", "const"):
        raise ValueError(f"parameter {text!r} has no name after its type")
    if stars:
        return ctypes.c_void_p
    if base not in _TYPES:
        raise ValueError(f"parameter {text!r} is not a pointer, int, int64_t or float")
    return _TYPES[base]


def parse_header(text: str, source: str = "k3_kernels.h") -> dict[str, list]:
    """The ctypes argument types of each ``int name(...)`` prototype in a header's text, in order:
    ``int64_t`` c_int64, ``int`` c_int, ``float`` c_float, any pointer c_void_p, ``(void)`` none.
    Parameter types are built from ``const``, those three, ``void`` and the header's
    ``typedef struct {...} name;`` names, with ``*``. Besides prototypes and those typedefs it takes
    only comments and preprocessor lines: anything else is a HeaderError naming the declaration."""
    lines = _COMMENT.sub(" ", text).splitlines()
    text = "\n".join(line for line in lines if not line.lstrip().startswith("#"))
    structs = set(_TYPEDEF.findall(text))
    table: dict[str, list] = {}
    for decl in _TYPEDEF.sub(" ", text).split(";"):
        decl = " ".join(_TOKEN.findall(decl))
        if not decl:
            continue
        named = re.search(r"([A-Za-z_]\w*) \(", decl)
        what = named.group(1) if named else repr(decl[:60])
        try:
            m = _PROTO.fullmatch(decl)
            if m is None:
                raise ValueError("not a prototype `int name(parameters);`")
            name, params = m.groups()
            if name in table:
                raise ValueError("declared twice")
            params = params.strip()
            if not params:
                raise ValueError("empty parameter list (no parameters is `(void)`)")
            if params == "void":
                table[name] = []
            else:
                table[name] = [_param(p.strip(), structs) for p in params.split(",")]
        except ValueError as e:
            raise HeaderError(f"{source}: cannot read the declaration of {what}: {e}") from None
    return table


def header_path() -> Path:
    """The header the prototypes are read from: ``$K3_KERNEL_HEADER``, else ``k3_kernels.h`` here."""
    return Path(os.environ.get("K3_KERNEL_HEADER") or Path(__file__).with_name("k3_kernels.h"))


def signatures() -> dict[str, list]:
    """Entry point name -> the ctypes argument types the loader gives it (``parse_header`` of
    ``header_path()``; a HeaderError where a prototype cannot be read)."""
    path = header_path()
    return parse_header(path.read_text(), str(path))


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
                table = signatures()
                path = _build()
                lib = ctypes.CDLL(str(path))
                gomp = _libgomps()
                if len(gomp) > 1:
                    raise OSError(f"two OpenMP runtimes in this process: {sorted(gomp)}")
                for name, argtypes in table.items():
                    try:
                        fn = getattr(lib, name)
                    except AttributeError:
                        raise OSError(f"{name} is declared in {header_path()} but {path} lacks it") from None
                    fn.argtypes, fn.restype = argtypes, ctypes.c_int
                check_layouts(lib)   # the ctypes structs against the C ones
                _LIB, _PATH = lib, path
            except (OSError, subprocess.SubprocessError, ValueError, RuntimeError) as e:
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
