"""The C kernels' interface as ctypes sees it: every entry point defined in the .c files (read here
with a regex of its own) is declared in k3_kernels.h and loaded with the argument types its
definition has; the header parser reads a hand-written header and refuses malformed prototypes,
naming them; the ctypes structs (k3.ops.kernel_structs) agree with the C ones, and a struct with fields
swapped or dropped is refused naming the field; a header declaring a function the library lacks,
one the parser cannot read, or a struct laid out wrongly leaves the kernels unavailable, the reason
naming it (in a subprocess)."""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from k3.ops import cpu_kernels, kernel_structs
from k3.ops.cpu_kernels import HeaderError, parse_header

_I64, _PTR, _INT, _F32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_float
_DEFINITION = re.compile(r"^int\s+(k3_\w+)\s*\(([^)]*)\)\s*\{", re.M)


def _definitions() -> dict[str, list]:
    """name -> the ctypes type of each parameter, read from the definitions in the .c sources."""
    found = {}
    for src in cpu_kernels.SOURCES:
        text = src.read_text()
        defs = _DEFINITION.findall(text)
        assert len(defs) == len(re.findall(r"^int\s+k3_", text, re.M)), src.name   # none missed
        for name, params in defs:
            assert name not in found, name
            kinds = []
            for p in params.split(","):
                words = re.findall(r"\w+", p)
                if words == ["void"]:
                    continue
                kinds.append(_PTR if "*" in p else _I64 if "int64_t" in words else _F32 if "float" in words
                             else _INT if "int" in words else None)
            found[name] = kinds
    return found


def test_every_defined_entry_point_is_declared_and_loaded_with_its_parameters():
    defined, declared = _definitions(), cpu_kernels.signatures()
    assert len(defined) >= 26 and "k3_struct_layout" in defined and defined["k3_wide_registers"] == []
    assert sorted(defined) == sorted(declared)
    assert cpu_kernels.unavailable() is None
    lib = cpu_kernels.library()
    for name, kinds in defined.items():
        assert len(declared[name]) == len(kinds), name
        assert declared[name] == kinds, name
        fn = getattr(lib, name)
        assert fn.argtypes == declared[name] and fn.restype is ctypes.c_int, name


_HEADER = """/* a header of the form k3_kernels.h takes */
#ifndef T_H
#define T_H
#include <stdint.h>
typedef struct {     /* comment; with ; inside */
    const float *w;
    int64_t K, N;
} t_mat;

int t_none(void);
int t_all(int64_t n, int k, float c, const float *x, float *y, int64_t *idx,
          const float *const *src, float *const *dst, const t_mat *m, void *p);   // a line comment
int t_unnamed(int64_t, const float *);
#endif
"""


def test_the_parser_reads_a_hand_written_header():
    assert parse_header(_HEADER) == {
        "t_none": [],
        "t_all": [_I64, _INT, _F32, _PTR, _PTR, _PTR, _PTR, _PTR, _PTR, _PTR],
        "t_unnamed": [_I64, _PTR]}


@pytest.mark.parametrize("decl,match", [
    ("float k3_bad(int n);", "not a prototype"),
    ("static int k3_bad(int n);", "not a prototype"),
    ("int k3_bad(long n);", "unknown type 'long'"),
    ("int k3_bad(unsigned int n);", "cannot read parameter"),
    ("int k3_bad(t_mat m);", "is not a pointer"),
    ("int k3_bad(void n);", "is not a pointer"),
    ("int k3_bad(int64_t n, void);", "is not a pointer"),
    ("int k3_bad();", "empty parameter list"),
    ("int k3_bad(float x[]);", "cannot read parameter"),
    ("int k3_bad(const float *restrict x);", "cannot read parameter"),
    ("int k3_bad(int (*f)(int));", "cannot read parameter"),
    ("int k3_bad(int64_t int);", "no name after its type"),
    ("int k3_bad(void);\nint k3_bad(void);", "declared twice"),
])
def test_the_parser_refuses_a_malformed_prototype_naming_it(decl, match):
    text = _HEADER.replace("#endif", decl + "\n#endif")
    assert "k3_bad" not in parse_header(_HEADER)                   # the control reads
    with pytest.raises(HeaderError, match=r"cannot read the declaration of k3_bad: .*" + re.escape(match)):
        parse_header(text)


def test_the_parser_refuses_what_is_not_a_prototype():
    with pytest.raises(HeaderError, match=re.escape("declaration of 'struct t_s { int a'")):
        parse_header(_HEADER + "struct t_s { int a; };\n")
    with pytest.raises(HeaderError, match="declaration of 'extern int k3_n'"):
        parse_header(_HEADER + "extern int k3_n;\n")


def test_the_ctypes_structs_agree_with_the_c_structs():
    lib = cpu_kernels.library()
    kernel_structs.check_layouts(lib)                              # also done at load
    for which, cls, _ in kernel_structs._STRUCTS:
        out = (ctypes.c_int64 * 256)()
        assert lib.k3_struct_layout(which, out, 256) == 1 + 2 * len(cls._fields_)
        assert out[0] == ctypes.sizeof(cls)
    assert lib.k3_struct_layout(4, out, 256) == -1 and lib.k3_struct_layout(1, out, 3) == -1


def _kda_like(fields):
    return type("KDALayer", (ctypes.Structure,), {"_fields_": fields})


_KDA = kernel_structs.KDALayer._fields_


def _swap(fields, a, b):
    names = [f[0] for f in fields]
    out = list(fields)
    i, j = names.index(a), names.index(b)
    out[i], out[j] = out[j], out[i]
    return out


@pytest.mark.parametrize("fields,match", [
    (_swap(_KDA, "G", "lb"), r"KDALayer\.lb \(field 11\) is at offset 184, 4 bytes; k3_kda_layer's field 11 at "
                             r"184, 8 bytes"),
    (_swap(_KDA, "w_f", "conv_w"), r"KDALayer\.conv_w \(field 1\)"),
    ([f for f in _KDA if f[0] != "w_gb"], r"KDALayer\.conv_w \(field 3\) is at offset 96, 8 bytes"),
    ([f for f in _KDA if f[0] != "c_o"], r"KDALayer has 16 fields, k3_kda_layer 17: none after KDALayer\.q_scale"),
    (_KDA + [("extra", ctypes.c_float)], r"KDALayer\.extra: field 17, but k3_kda_layer has 17 fields"),
])
def test_a_struct_laid_out_otherwise_is_refused_naming_the_field(fields, match):
    lib = cpu_kernels.library()
    kernel_structs.check_layouts(lib, [(1, _kda_like(_KDA), "k3_kda_layer")])     # the control: a true copy
    with pytest.raises(RuntimeError, match="kernel structs: " + match):
        kernel_structs.check_layouts(lib, [(1, _kda_like(fields), "k3_kda_layer")])


def _run(tmp_path, code: str, header: str | None = None) -> str:
    """Runs code in a fresh process over a cache holding only a copy of this process's kernels (so
    nothing is rebuilt) and, given, a header read in place of k3_kernels.h; returns its stdout."""
    cache = tmp_path / "kernels"
    cache.mkdir()
    env = {**os.environ, "K3_KERNEL_CACHE": str(cache)}
    if header is not None:
        (tmp_path / "k3_kernels.h").write_text(header)
        env["K3_KERNEL_HEADER"] = str(tmp_path / "k3_kernels.h")
    so = cpu_kernels.kernel_path()
    shutil.copy(so, cache / so.name)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr
    return out.stdout


_REASON = """
from k3.ops import cpu_kernels, decode_layers, kernel_structs
{patch}
why = cpu_kernels.unavailable()
print(why)
try:
    cpu_kernels.library()
except RuntimeError as e:
    assert str(e) == why
else:
    assert why is None
"""

_BAD_KDA = """
import ctypes
f = list(kernel_structs.KDALayer._fields_)
f[11], f[12] = f[12], f[11]
bad = type("KDALayer", (ctypes.Structure,), {"_fields_": f})
kernel_structs._STRUCTS = tuple((w, bad if c is kernel_structs.KDALayer else c, n) for w, c, n in kernel_structs._STRUCTS)
"""


def _header_with(decl: str) -> str:
    text = Path(cpu_kernels.__file__).with_name("k3_kernels.h").read_text()
    assert text.count("#endif") == 1
    return text.replace("#endif", decl + "\n#endif")


def test_the_unaltered_header_copy_loads(tmp_path):
    assert _run(tmp_path, _REASON.format(patch=""), _header_with("")).strip() == "None"   # the control


@pytest.mark.parametrize("decl,match", [
    ("int k3_absent(int64_t n, float *x);", r"k3_absent is declared in .*k3_kernels\.h but .*\.so lacks it"),
    ("int k3_absent(long n);", r".*k3_kernels\.h: cannot read the declaration of k3_absent: unknown type 'long'"),
])
def test_a_header_the_library_does_not_match_leaves_the_kernels_unavailable(tmp_path, decl, match):
    why = _run(tmp_path, _REASON.format(patch=""), _header_with(decl)).strip()
    assert re.search(r"^the CPU kernels cannot be built or loaded: " + match, why), why


def test_a_struct_laid_out_otherwise_leaves_the_kernels_unavailable(tmp_path):
    why = _run(tmp_path, _REASON.format(patch=_BAD_KDA)).strip()
    assert re.search(r"^the CPU kernels cannot be built or loaded: kernel structs: KDALayer\.lb \(field 11\)", why), why


def test_importing_decode_layers_builds_and_loads_nothing(tmp_path):
    code = ("from k3.ops import cpu_kernels, decode_layers\n"
            "assert cpu_kernels._LIB is None and cpu_kernels._WHY is None\nprint('ok')\n")
    assert _run(tmp_path, code).strip() == "ok"
    assert [p.name for p in (tmp_path / "kernels").iterdir()] == [cpu_kernels.kernel_path().name]
