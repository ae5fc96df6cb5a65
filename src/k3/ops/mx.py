"""MXFP4 / MXFP8 microscaling (OCP MX v1.0; SPEC §3.7).

A tensor x [..., n] is cut into blocks of ``block`` (32) consecutive elements along the last dim.
Each block shares one E8M0 scale X = 2^s and stores elements P_i in a narrow float format:

    s   = clamp(floor(log2(max_i |x_i|)) − emax_elem, −127, 127)      E8M0 byte = s + 127
    P_i = round_to_nearest_even(x_i / 2^s), saturated to ±max_normal
    x̂_i = P_i · 2^s

| fmt        | element        | emax_elem | max_normal | code                                      |
|------------|----------------|-----------|------------|-------------------------------------------|
| fp4_e2m1   | E2M1 (bias 1)  | 2         | 6.0        | uint8 holding a nibble: bit 3 sign, bits 0-2 magnitude |
| fp8_e4m3   | E4M3FN (bias 7)| 8         | 448.0      | uint8 bit pattern of torch.float8_e4m3fn  |

E2M1 magnitudes for codes 0..7 are {0, .5, 1, 1.5, 2, 3, 4, 6}. FP8 codes are returned as uint8
(``codes.view(torch.float8_e4m3fn)`` reinterprets them) so both formats share one layout.

Special blocks (decisions documented here, tested in tests/ops/test_mx.py):
- NaN anywhere in a block → scale byte 0xFF (E8M0 NaN); the block's codes are all 0 and it
  dequantizes to all-NaN.
- ±Inf anywhere in a block → treated like NaN (scale 0xFF). Neither element format can hold an
  infinity, and saturating it would silently zero the rest of the block (its amax is infinite).
- All-zero block → scale byte 0 (2^−127, what the formula gives after clamping log2(0) = −∞)
  and all-zero codes; the sign of −0.0 is kept, as in an IEEE cast.

Exactness: |x| / 2^s is formed in float64, where it is exact for every E8M0 exponent and every
input dtype up to fp32 (and unaffected by ``torch.set_flush_denormal``). Elements are then rounded
by comparisons only (``torch.bucketize`` against the midpoints between representable values, the
tie rule built into the boundaries), so nothing is rounded twice. Exponents are read from float64
bit fields, never from ``log2``. (Under ``torch.set_flush_denormal(True)`` the CPU itself reads
fp32 subnormal inputs as zero, so a block whose amax is below 2^−126 then quantizes as zero.)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = [
    "dequantize_fp4_packed",
    "MX_FORMATS",
    "quantize_mx",
    "dequantize_mx",
    "fake_quant_mx",
    "pack_fp4",
    "unpack_fp4",
    "E8M0_NAN",
]

E8M0_BIAS = 127
E8M0_NAN = 0xFF


@dataclass(frozen=True)
class _ElemFormat:
    ebits: int
    mbits: int
    bias: int
    max_normal: float
    nan_code: int | None  # magnitude code reserved for NaN (E4M3FN: 0x7F), None when absent

    @property
    def emax(self) -> int:  # exponent of the largest normal number (emax_elem of the spec)
        return int(torch.tensor(self.max_normal, dtype=torch.float64).log2().floor())

    @property
    def emin(self) -> int:  # exponent of the smallest normal number
        return 1 - self.bias

    @property
    def sign_bit(self) -> int:
        return 1 << (self.ebits + self.mbits)


MX_FORMATS: dict[str, _ElemFormat] = {
    "fp4_e2m1": _ElemFormat(ebits=2, mbits=1, bias=1, max_normal=6.0, nan_code=None),
    "fp8_e4m3": _ElemFormat(ebits=4, mbits=3, bias=7, max_normal=448.0, nan_code=0x7F),
}


def _format(fmt: str) -> _ElemFormat:
    if fmt not in MX_FORMATS:
        raise ValueError(f"unsupported MX format {fmt!r}; expected one of {sorted(MX_FORMATS)}")
    return MX_FORMATS[fmt]


def _blocks(x: torch.Tensor, block: int, what: str) -> torch.Tensor:
    """[..., n] -> [..., n/block, block], with a ValueError naming the shape when n % block != 0."""
    if block <= 0:
        raise ValueError(f"block must be positive, got {block}")
    if x.dim() == 0 or x.shape[-1] % block != 0:
        raise ValueError(
            f"{what} of shape {tuple(x.shape)}: last dim must be a non-zero multiple of the MX block size {block}"
        )
    return x.reshape(*x.shape[:-1], x.shape[-1] // block, block)


def _floor_log2(a: torch.Tensor) -> torch.Tensor:
    """floor(log2 a) for finite float64 a > 0 read from the exponent field (−1023 for 0/subnormals)."""
    return ((a.view(torch.int64) >> 52) & 0x7FF) - 1023


def _pow2(e: torch.Tensor) -> torch.Tensor:
    """2^e as float64, built from the exponent field; exact for integer e in [−1022, 1023]."""
    return ((e.to(torch.int64) + 1023) << 52).view(torch.float64)


def _rounding_boundaries(f: _ElemFormat, device: torch.device) -> torch.Tensor:
    """float64 [M−1] boundaries for ``torch.bucketize`` mapping a magnitude to its nearest code.

    Between codes i and i+1 the decision point is the midpoint t_i. bucketize counts boundaries
    strictly below a, so a tie a = t_i stays on code i; when code i is odd the tie must go up to
    the even code i+1, so that boundary is moved one float64 ulp down (a ≥ t_i ⟺ a > prev(t_i),
    exact because a is a float64). Codes are ordered by magnitude and the last one is the max
    normal, so values beyond it saturate without a clamp.
    """
    mags = _decode_table(f, device)[: f.sign_bit]
    if f.nan_code is not None:
        mags = mags[: f.nan_code]
    mid = (mags[1:] + mags[:-1]) / 2  # exact: a few significant bits
    lower_odd = torch.arange(len(mid), device=device) % 2 == 1
    return torch.where(lower_odd, torch.nextafter(mid, torch.zeros_like(mid)), mid)


def quantize_mx(x: torch.Tensor, fmt: str, block: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [..., n] float -> (codes uint8 [..., n], scales uint8 [..., n/block]) (E8M0 bytes)."""
    f = _format(fmt)
    if not x.is_floating_point():
        raise ValueError(f"quantize_mx expects a floating-point tensor, got {x.dtype}")
    xb = _blocks(x, block, "quantize_mx input")
    ax = xb.abs()
    amax = ax.amax(dim=-1).to(torch.float64)  # NaN and Inf propagate
    special = ~torch.isfinite(amax)  # NaN or ±Inf in the block → NaN scale
    any_special = bool(special.any())
    amax = amax.masked_fill(special, 0.0)
    shared = torch.clamp(_floor_log2(amax) - f.emax, -E8M0_BIAS, E8M0_BIAS)  # log2(0) → clamps to −127
    a = ax * _pow2(-shared).unsqueeze(-1)  # promoted to float64: an exact division by 2^shared
    if any_special:
        a = a.masked_fill(special.unsqueeze(-1), 0.0)
    mag = torch.bucketize(a, _rounding_boundaries(f, x.device), out_int32=True)
    code = torch.where(torch.signbit(xb), mag + f.sign_bit, mag).to(torch.uint8)
    if any_special:
        code = code.masked_fill(special.unsqueeze(-1), 0)
    scales = torch.where(special, E8M0_NAN, shared + E8M0_BIAS).to(torch.uint8)
    return code.reshape(x.shape), scales


def _decode_table(f: _ElemFormat, device: torch.device) -> torch.Tensor:
    """float64 [2^(1+ebits+mbits)]: the value of every element code."""
    codes = torch.arange(1 << (1 + f.ebits + f.mbits), device=device)
    mag = codes & (f.sign_bit - 1)
    e_field, m_field = mag >> f.mbits, mag & ((1 << f.mbits) - 1)
    subnormal = m_field.double() * _pow2(torch.full_like(mag, f.emin - f.mbits))
    normal = (m_field + (1 << f.mbits)).double() * _pow2(e_field - f.bias - f.mbits)
    val = torch.where(e_field == 0, subnormal, normal)
    if f.nan_code is not None:
        val = torch.where(mag == f.nan_code, float("nan"), val)
    return torch.where(codes & f.sign_bit != 0, -val, val)


def dequantize_mx(
    codes: torch.Tensor, scales: torch.Tensor, fmt: str, block: int = 32, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """codes uint8 [..., n], scales uint8 [..., n/block] -> x̂ [..., n] in ``dtype``."""
    f = _format(fmt)
    if scales is None:
        raise ValueError("dequantize_mx needs the E8M0 scales")
    cb = _blocks(codes, block, "dequantize_mx codes")
    if codes.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"codes and scales must be uint8, got {codes.dtype} and {scales.dtype}")
    if tuple(scales.shape) != tuple(cb.shape[:-1]):
        raise ValueError(
            f"scales of shape {tuple(scales.shape)} do not match codes of shape {tuple(codes.shape)} "
            f"(expected {tuple(cb.shape[:-1])} for block {block})"
        )
    ncodes = 1 << (1 + f.ebits + f.mbits)
    if codes.numel() and int(codes.max()) >= ncodes:
        raise ValueError(f"{fmt} codes must be < {ncodes}; got {int(codes.max())} (packed FP4 needs unpack_fp4 first)")
    s = scales.to(torch.int64)
    table = _decode_table(f, codes.device)
    if scales.numel() and int(s.min()) >= E8M0_BIAS - 100 and int(s.max()) <= E8M0_BIAS + 100:
        # Fast path (every real weight/activation): element magnitudes lie in [2^-9, 448] and the
        # scale in [2^-100, 2^100], so the float32 product is a normal number, hence exact.
        scale = torch.where(s == E8M0_NAN, float("nan"), _pow2(s - E8M0_BIAS)).float()
        vals = table.float()[cb.long()] * scale.unsqueeze(-1)
    else:
        scale = torch.where(s == E8M0_NAN, float("nan"), _pow2(s - E8M0_BIAS))
        # A decoded value has ≤ 4 significant bits, so the float32 step is exact unless the value
        # leaves float32's exponent range; a bf16/fp16 target is then rounded once.
        vals = (table[cb.long()] * scale.unsqueeze(-1)).to(torch.float32)
    return vals.reshape(codes.shape).to(dtype)


def fake_quant_mx(x: torch.Tensor, fmt: str, block: int = 32) -> torch.Tensor:
    """dequantize(quantize(x)) in x's dtype with a straight-through gradient: x + (x̂ − x).detach()."""
    with torch.no_grad():
        codes, scales = quantize_mx(x.detach(), fmt, block)
        dq = dequantize_mx(codes, scales, fmt, block, dtype=x.dtype)
    return x + (dq - x).detach()


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """codes uint8 [..., n] (nibbles) -> uint8 [..., ceil(n/2)]; element 2i low nibble, 2i+1 high.

    An odd n is padded with a zero nibble.
    """
    if codes.dtype != torch.uint8:
        raise ValueError(f"pack_fp4 expects uint8 codes, got {codes.dtype}")
    if codes.dim() == 0:
        raise ValueError("pack_fp4 expects at least one dimension")
    if codes.numel() and int(codes.max()) > 0xF:
        raise ValueError(f"pack_fp4 codes must be 4-bit (< 16); got {int(codes.max())}")
    if codes.shape[-1] % 2:
        codes = torch.cat([codes, codes.new_zeros(*codes.shape[:-1], 1)], dim=-1)
    pairs = codes.reshape(*codes.shape[:-1], codes.shape[-1] // 2, 2)
    return pairs[..., 0] | (pairs[..., 1] << 4)


def unpack_fp4(packed: torch.Tensor, n: int) -> torch.Tensor:
    """packed uint8 [..., ceil(n/2)] -> codes uint8 [..., n] (inverse of pack_fp4)."""
    if packed.dtype != torch.uint8:
        raise ValueError(f"unpack_fp4 expects uint8, got {packed.dtype}")
    if packed.dim() == 0 or packed.shape[-1] != (n + 1) // 2:
        raise ValueError(
            f"packed FP4 tensor of shape {tuple(packed.shape)} cannot hold n={n} codes "
            f"(last dim must be ceil(n/2) = {(n + 1) // 2})"
        )
    codes = torch.stack([packed & 0xF, packed >> 4], dim=-1)
    return codes.reshape(*packed.shape[:-1], -1)[..., :n]


_PAIR_TABLES: dict[torch.device, torch.Tensor] = {}


def _fp4_pair_table(device: torch.device) -> torch.Tensor:
    """float32 [256, 2]: the two E2M1 values held by each packed byte (low nibble first)."""
    t = _PAIR_TABLES.get(device)
    if t is None:
        vals = _decode_table(_format("fp4_e2m1"), device).float()
        byte = torch.arange(256, device=device)
        t = _PAIR_TABLES[device] = torch.stack([vals[byte & 0xF], vals[byte >> 4]], dim=-1)
    return t


def dequantize_fp4_packed(packed: torch.Tensor, scales: torch.Tensor, n: int, block: int = 32,
                          dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Packed MXFP4 straight to values: packed uint8 [..., n/2], scales uint8 [..., n/block] -> [..., n].

    Equal to ``dequantize_mx(unpack_fp4(packed, n), scales, "fp4_e2m1", block, dtype)``, but one
    byte-indexed lookup of both nibbles replaces unpacking and the per-code table walk (the decode
    path of packed experts runs this for every active expert at every step). Falls back to that
    composition where the fast path's exactness argument does not hold (scales far from 2^0).
    """
    if packed.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"packed codes and scales must be uint8, got {packed.dtype} and {scales.dtype}")
    if n % block or n % 2 or packed.shape[-1] != n // 2 or tuple(scales.shape) != (*packed.shape[:-1], n // block):
        return dequantize_mx(unpack_fp4(packed, n), scales, "fp4_e2m1", block, dtype)
    s = scales.to(torch.int32)
    finite = torch.where(s == E8M0_NAN, E8M0_BIAS, s)
    if s.numel() and (int(finite.min()) < E8M0_BIAS - 100 or int(finite.max()) > E8M0_BIAS + 100):
        return dequantize_mx(unpack_fp4(packed, n), scales, "fp4_e2m1", block, dtype)
    # |E2M1| ≤ 6 times 2^±100 (or NaN): the float32 product is exact, as in dequantize_mx.
    scale = torch.where(s == E8M0_NAN, float("nan"), torch.exp2((s - E8M0_BIAS).float()))
    # embedding is a row gather: ~8x faster on CPU than advanced indexing with int64 indices
    vals = torch.nn.functional.embedding(packed.int(), _fp4_pair_table(packed.device))   # [..., n/2, 2]
    vals = vals.reshape(*packed.shape[:-1], n // block, block) * scale.unsqueeze(-1)
    return vals.reshape(*packed.shape[:-1], n).to(dtype)

