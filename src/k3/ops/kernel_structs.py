"""The ctypes mirrors of the C structs the decode layers are described by (``k3_kernels.h``:
``k3_mat``, ``k3_kda_layer``, ``k3_mla_layer``, ``k3_moe_layer``), and the check that they agree.

When the kernels load (``k3.ops.cpu_kernels``), ``check_layouts`` compares each ctypes struct's size
and its fields' offsets and sizes with ``k3_struct_layout``'s; a difference leaves the kernels
unavailable, the reason naming the struct and the field. This module imports nothing of k3, so the
loader can use it."""

from __future__ import annotations

import ctypes

__all__ = ["Mat", "KDALayer", "MLALayer", "MoELayer", "check_layouts"]

_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float


class Mat(ctypes.Structure):
    _fields_ = [("w", _P), ("K", _I), ("N", _I), ("E", _I)]


class KDALayer(ctypes.Structure):
    _fields_ = [("w_in", Mat), ("w_f", Mat), ("w_gb", Mat), ("w_o", Mat),
                ("conv_w", _P), ("f_bias", _P), ("neg_a", _P),
                ("nh", _I), ("d", _I), ("Kc", _I), ("fa", _I), ("G", _I),
                ("lb", _F), ("c_in", _F), ("c_qk", _F), ("q_scale", _F), ("c_o", _F)]


class MLALayer(ctypes.Structure):
    _fields_ = [("w_in", Mat), ("w_q", Mat), ("w_o", Mat), ("w_uv_t", _P), ("kv_w", _P),
                ("nh", _I), ("r", _I), ("p", _I), ("vd", _I), ("qdim", _I), ("gated", _I),
                ("c_in", _F), ("c_q", _F), ("c_kv", _F)]


class MoELayer(ctypes.Structure):
    _fields_ = [("w_in", Mat), ("w13", Mat), ("w2", Mat), ("w_up", Mat), ("w_sd", Mat),
                ("bias", _P), ("gamma", _P),
                ("E", _I), ("k", _I), ("F", _I), ("Fs", _I), ("ell", _I), ("softmax", _I), ("renorm", _I),
                ("silu", _I), ("tanh_up", _I),
                ("tiny", _F), ("inv_beta", _F), ("c_in", _F), ("c_u", _F)]


_STRUCTS = ((0, Mat, "k3_mat"), (1, KDALayer, "k3_kda_layer"), (2, MLALayer, "k3_mla_layer"),
            (3, MoELayer, "k3_moe_layer"))


def _layout_mismatch(lib, which: int, cls, c_name: str) -> str | None:
    """Where ctypes struct ``cls`` differs from C struct number ``which`` (None where it does not)."""
    out = (ctypes.c_int64 * 256)()
    n = lib.k3_struct_layout(which, out, len(out))
    if n < 1 or n % 2 != 1:
        return f"k3_struct_layout({which}) returned {n}"
    c = [(out[i], out[i + 1]) for i in range(1, n, 2)]    # (offset, size) of each C field
    names = [f[0] for f in cls._fields_]
    for i, name in enumerate(names):
        f = getattr(cls, name)
        if i >= len(c):
            return f"{cls.__name__}.{name}: field {i}, but {c_name} has {len(c)} fields"
        if (f.offset, f.size) != c[i]:
            return (f"{cls.__name__}.{name} (field {i}) is at offset {f.offset}, {f.size} bytes; {c_name}'s "
                    f"field {i} at {c[i][0]}, {c[i][1]} bytes")
    if len(c) > len(names):
        return (f"{cls.__name__} has {len(names)} fields, {c_name} {len(c)}: none after "
                f"{cls.__name__}.{names[-1]} for {c_name}'s field {len(names)} at offset {c[len(names)][0]}")
    if ctypes.sizeof(cls) != out[0]:
        return f"{cls.__name__} takes {ctypes.sizeof(cls)} bytes, {c_name} {out[0]}"
    return None


def check_layouts(lib, structs=None) -> None:
    """RuntimeError naming the struct and the field where a ctypes struct here is laid out otherwise
    than its C struct in the loaded kernels ``lib`` (``cpu_kernels`` calls this when it loads them).
    ``structs``: (number for ``k3_struct_layout``, ctypes struct, C name) triples; default all four."""
    if not hasattr(lib, "k3_struct_layout"):
        raise RuntimeError("kernel structs: the kernels lack k3_struct_layout")
    for which, cls, c_name in _STRUCTS if structs is None else structs:
        why = _layout_mismatch(lib, which, cls, c_name)
        if why:
            raise RuntimeError(f"kernel structs: {why}")
