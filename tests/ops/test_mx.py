"""k3.ops.mx against references written here (enumerate-and-pick-nearest, a per-block numpy
quantizer), torch's own float8_e4m3fn cast, and torchao's ``to_mx`` when installed."""

import math

import numpy as np
import pytest
import torch

from k3.ops.mx import dequantize_fp4_packed, dequantize_mx, fake_quant_mx, pack_fp4, quantize_mx, unpack_fp4

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]  # magnitude of codes 0..7 (OCP MX v1.0 table)
FMTS = ["fp4_e2m1", "fp8_e4m3"]


def _e4m3_magnitudes() -> np.ndarray:
    """Magnitudes of E4M3FN codes 0..126 decoded by torch (0x7F is NaN)."""
    return torch.arange(127, dtype=torch.uint8).view(torch.float8_e4m3fn).double().numpy()


REF = {
    "fp4_e2m1": dict(mags=np.array(E2M1), emax=2, sign=0x8),
    "fp8_e4m3": dict(mags=_e4m3_magnitudes(), emax=8, sign=0x80),
}


def _nearest_code(v: np.ndarray, mags: np.ndarray) -> np.ndarray:
    """Index of the nearest magnitude to |v|, ties to the even code (even mantissa); saturating."""
    a = np.minimum(np.abs(v), mags[-1])[..., None]
    d = np.abs(a - mags)
    best = d.min(axis=-1, keepdims=True)
    cand = d == best
    even = cand & (np.arange(len(mags)) % 2 == 0)
    return np.where(even.any(-1), even.argmax(-1), cand.argmax(-1))


def _reference_quantize(x: torch.Tensor, fmt: str, block: int = 32):
    """Plain per-block quantizer (loop over blocks, numpy float64)."""
    r = REF[fmt]
    xs = x.double().numpy().reshape(-1, block)
    codes = np.zeros(xs.shape, dtype=np.uint8)
    scales = np.zeros(len(xs), dtype=np.uint8)
    for i, b in enumerate(xs):
        if not np.isfinite(b).all():
            scales[i] = 255
            continue
        amax = np.abs(b).max()
        e = math.frexp(amax)[1] - 1 if amax > 0 else -1000  # floor(log2 amax)
        s = min(max(e - r["emax"], -127), 127)
        scales[i] = s + 127
        v = b / 2.0**s
        codes[i] = _nearest_code(v, r["mags"]) | np.where(np.signbit(v), r["sign"], 0)
    return (torch.from_numpy(codes).reshape(x.shape), torch.from_numpy(scales).reshape(*x.shape[:-1], -1))


def _student_t(shape, seed, df=2.0):
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(shape, generator=g)
    chi2 = torch.randn(shape + (int(df),), generator=g).pow(2).sum(-1)
    return z / torch.sqrt(chi2 / df) * 10.0 ** torch.randint(-3, 4, shape[:-1] + (1,), generator=g)


def _with_unit_scale(vals: torch.Tensor, anchor: float) -> torch.Tensor:
    """Blocks of 31 values plus `anchor` first, so each block's shared scale is 2^0."""
    pad = (-len(vals)) % 31
    v = torch.cat([vals, torch.zeros(pad, dtype=vals.dtype)]).reshape(-1, 31)
    return torch.cat([torch.full((len(v), 1), anchor, dtype=vals.dtype), v], dim=1)


def test_every_e2m1_code_decodes_to_its_value():
    codes = torch.arange(16, dtype=torch.uint8).repeat(2)
    scales = torch.tensor([127], dtype=torch.uint8)
    want = torch.tensor(E2M1 + [-v for v in E2M1]).repeat(2)
    got = dequantize_mx(codes, scales, "fp4_e2m1")
    assert torch.equal(got, want)
    assert torch.equal(torch.signbit(got[8]), torch.tensor(True))  # code 8 is −0


def test_every_e4m3_code_decodes_like_torch_float8():
    codes = torch.arange(256, dtype=torch.uint8).reshape(8, 32)
    scales = torch.full((8, 1), 127 - 3, dtype=torch.uint8)  # 2^-3
    want = codes.view(torch.float8_e4m3fn).double() / 8
    got = dequantize_mx(codes, scales, "fp8_e4m3", dtype=torch.float64)
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got.nan_to_num(), want.nan_to_num())


def test_e2m1_rounds_dense_grid_to_nearest_with_ties_to_even():
    grid = torch.arange(-8 * 128 + 1, 8 * 128) / 128.0  # multiples of 1/64 and all their midpoints
    x = _with_unit_scale(grid, anchor=4.0)  # amax in [4, 8) → shared_exp 0
    codes, scales = quantize_mx(x, "fp4_e2m1")
    assert (scales == 127).all()
    want = _nearest_code(x.double().numpy(), np.array(E2M1)) | np.where(x.numpy() < 0, 0x8, 0)
    assert torch.equal(codes, torch.from_numpy(want.astype(np.uint8)))
    # spot checks of the ties: 0.25→0, 0.75→1.0, 1.25→1.0, 1.75→2, 2.5→2, 3.5→4, 5→4
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, -5.0])
    dq = dequantize_mx(*quantize_mx(_with_unit_scale(ties, 4.0), "fp4_e2m1"), "fp4_e2m1")
    assert dq[0, 1:10].tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, -4.0]


def test_e4m3_rounding_matches_torch_float8_cast_in_range():
    mags = torch.from_numpy(_e4m3_magnitudes()).float()
    mids = (mags[1:] + mags[:-1]) / 2  # exact ties, including the subnormal range
    g = torch.Generator().manual_seed(0)
    rand = torch.rand(4000, generator=g) * 448 * torch.exp2(-torch.randint(0, 20, (4000,), generator=g).float())
    vals = torch.cat([mags, mids, rand, mags / 3, torch.tensor([2.0**-10, 3 * 2.0**-11, 2.0**-12])])
    vals = torch.cat([vals, -vals])
    x = _with_unit_scale(vals, anchor=256.0)  # amax in [256, 512) → shared_exp 0
    codes, scales = quantize_mx(x, "fp8_e4m3")
    assert (scales == 127).all()
    assert torch.equal(codes, x.to(torch.float8_e4m3fn).view(torch.uint8))


def test_scale_selection_on_hand_computed_blocks():
    def first_scale(amax, fmt):
        x = torch.zeros(1, 32, dtype=torch.float64)
        x[0, 5] = amax
        x[0, 7] = amax / 3
        return int(quantize_mx(x, fmt)[1][0, 0])

    # floor(log2 amax) − emax + 127
    assert first_scale(1.0, "fp4_e2m1") == 0 - 2 + 127
    assert first_scale(0.99, "fp4_e2m1") == -1 - 2 + 127
    assert first_scale(6.0, "fp4_e2m1") == 2 - 2 + 127
    assert first_scale(-7.99, "fp4_e2m1") == 2 - 2 + 127
    assert first_scale(8.0, "fp4_e2m1") == 3 - 2 + 127
    assert first_scale(448.0, "fp8_e4m3") == 8 - 8 + 127
    assert first_scale(1.0, "fp8_e4m3") == -8 + 127
    assert first_scale(2.0**-140, "fp4_e2m1") == 0  # clamped to the smallest E8M0 scale 2^-127
    assert first_scale(2.0**-149, "fp8_e4m3") == 0
    assert first_scale(3.0e38, "fp4_e2m1") == 127 - 2 + 127
    assert first_scale(2.0**200, "fp8_e4m3") == 254  # float64 input beyond E8M0: clamped to 2^127
    # elements are divided by the scale: amax 1.0 → scale 2^-2, 0.3 / 0.25 = 1.2 → 1.0 → 0.25
    x = torch.zeros(32)
    x[:2] = torch.tensor([1.0, 0.3])
    codes, scales = quantize_mx(x, "fp4_e2m1")
    assert codes[:2].tolist() == [7 - 1, 2]  # 1/0.25 = 4 → code 6; 1.2 → 1.0 → code 2
    assert dequantize_mx(codes, scales, "fp4_e2m1")[:2].tolist() == [1.0, 0.25]


@pytest.mark.parametrize("fmt", FMTS)
def test_nan_inf_and_zero_blocks(fmt):
    x = torch.randn(5, 32)
    x[0, 3] = float("nan")
    x[1, 0] = float("inf")
    x[2, 31] = -float("inf")
    x[3] = 0.0
    codes, scales = quantize_mx(x.reshape(1, 160), fmt)
    codes, scales = codes.reshape(5, 32), scales.reshape(5)
    assert scales[:4].tolist() == [255, 255, 255, 0]
    assert scales[4] != 255
    assert (codes[:4] == 0).all()
    dq = dequantize_mx(codes.reshape(1, 160), scales.reshape(1, 5), fmt).reshape(5, 32)
    assert dq[:3].isnan().all()
    assert (dq[3] == 0).all()
    assert torch.isfinite(dq[4]).all()
    assert torch.equal(dq[4], dequantize_mx(*quantize_mx(x[4], fmt), fmt))  # other blocks untouched


def test_saturation_to_max_normal():
    x = torch.zeros(2, 32)
    x[0, :3] = torch.tensor([7.9, -7.0, 5.6])  # scale 2^0; 7.9 and 7 exceed E2M1's 6
    x[1, :3] = torch.tensor([500.0, -470.0, 460.0])  # scale 2^0; > 448 would be NaN in a plain e4m3 cast
    dq4 = dequantize_mx(*quantize_mx(x[:1], "fp4_e2m1"), "fp4_e2m1")
    dq8 = dequantize_mx(*quantize_mx(x[1:], "fp8_e4m3"), "fp8_e4m3")
    assert dq4[0, :3].tolist() == [6.0, -6.0, 6.0]
    assert dq8[0, :3].tolist() == [448.0, -448.0, 448.0]


@pytest.mark.parametrize("fmt", FMTS)
def test_bit_identical_to_per_block_numpy_reference_on_heavy_tails(fmt):
    x = _student_t((48, 256), seed=1)
    x[3, 40:50] = 0.0
    x[7, :32] = 0.0
    x[9, 64:96] *= 1e-38  # fp32 subnormals
    codes, scales = quantize_mx(x, fmt)
    ref_codes, ref_scales = _reference_quantize(x, fmt)
    assert torch.equal(scales, ref_scales)
    assert torch.equal(codes, ref_codes)


@pytest.mark.parametrize("fmt", FMTS)
def test_bit_identical_to_torchao_to_mx(fmt):
    import torchao  # noqa: F401  (a pinned test dependency)
    from torchao.prototype.mx_formats.mx_tensor import to_mx

    elem = torch.float4_e2m1fn_x2 if fmt == "fp4_e2m1" else torch.float8_e4m3fn
    x = _student_t((64, 512), seed=2)
    ref_scales, ref_data = to_mx(x, elem, 32)
    codes, scales = quantize_mx(x, fmt)
    assert torch.equal(scales, ref_scales.view(torch.uint8).reshape(scales.shape))
    packed = pack_fp4(codes) if fmt == "fp4_e2m1" else codes
    assert torch.equal(packed, ref_data.view(torch.uint8))


@pytest.mark.parametrize("fmt", FMTS)
def test_dequantize_error_is_within_half_a_quantum(fmt):
    x = _student_t((16, 128), seed=3)
    codes, scales = quantize_mx(x, fmt)
    dq = dequantize_mx(codes, scales, fmt, dtype=torch.float64)
    rel_step = 0.25 if fmt == "fp4_e2m1" else 2.0**-4  # half a ulp relative to the binade
    xb, db = x.double().reshape(16, 4, 32), dq.reshape(16, 4, 32)
    s = torch.exp2(scales.double() - 127).unsqueeze(-1)
    sat = REF[fmt]["mags"][-1]
    # error ≤ half an ulp of the element format, floored at half the smallest subnormal, or saturation
    ulp_half = torch.maximum(xb.abs() * rel_step, s * (0.25 if fmt == "fp4_e2m1" else 2.0**-10))
    ok = ((db - xb).abs() <= ulp_half * (1 + 1e-12)) | ((db.abs() == sat * s) & (xb.abs() >= sat * s))
    assert ok.all()


def test_quantize_accepts_bf16_and_dequantizes_to_requested_dtype():
    x = _student_t((4, 64), seed=4).bfloat16()
    codes, scales = quantize_mx(x, "fp4_e2m1")
    ref_codes, ref_scales = _reference_quantize(x.float(), "fp4_e2m1")
    assert torch.equal(codes, ref_codes) and torch.equal(scales, ref_scales)
    dq = dequantize_mx(codes, scales, "fp4_e2m1", dtype=torch.bfloat16)
    assert dq.dtype == torch.bfloat16
    assert torch.equal(dq.float(), dequantize_mx(codes, scales, "fp4_e2m1"))


@pytest.mark.parametrize("n", [1, 2, 7, 32, 33])
def test_pack_unpack_round_trip(n):
    codes = torch.randint(0, 16, (3, 5, n), dtype=torch.uint8)
    packed = pack_fp4(codes)
    assert packed.shape == (3, 5, (n + 1) // 2) and packed.dtype == torch.uint8
    assert torch.equal(unpack_fp4(packed, n), codes)
    if n % 2:
        assert (packed[..., -1] >> 4 == 0).all()  # padding nibble is zero


def test_pack_puts_even_element_in_low_nibble():
    assert pack_fp4(torch.tensor([0x1, 0x2, 0x3], dtype=torch.uint8)).tolist() == [0x21, 0x03]
    assert unpack_fp4(torch.tensor([0xA5], dtype=torch.uint8), 2).tolist() == [0x5, 0xA]


def test_fake_quant_forward_and_straight_through_gradient():
    x = _student_t((4, 96), seed=5).requires_grad_(True)
    y = fake_quant_mx(x, "fp4_e2m1")
    assert torch.equal(y.detach(), dequantize_mx(*quantize_mx(x.detach(), "fp4_e2m1"), "fp4_e2m1"))
    g = torch.randn_like(x)
    (y * g).sum().backward()
    assert torch.equal(x.grad, g)
    xb = x.detach().bfloat16().requires_grad_(True)
    yb = fake_quant_mx(xb, "fp8_e4m3")
    assert yb.dtype == torch.bfloat16
    yb.sum().backward()
    assert torch.equal(xb.grad, torch.ones_like(xb))


def test_clear_errors():
    with pytest.raises(ValueError, match=r"\(4, 48\)"):
        quantize_mx(torch.randn(4, 48), "fp4_e2m1")
    with pytest.raises(ValueError, match="unsupported MX format 'int4'"):
        quantize_mx(torch.randn(4, 32), "int4")
    with pytest.raises(ValueError, match="floating-point"):
        quantize_mx(torch.ones(32, dtype=torch.int32), "fp4_e2m1")
    codes, scales = quantize_mx(torch.randn(4, 64), "fp4_e2m1")
    with pytest.raises(ValueError, match="scales of shape"):
        dequantize_mx(codes, scales[:, :1], "fp4_e2m1")
    with pytest.raises(ValueError, match="needs the E8M0 scales"):
        dequantize_mx(codes, None, "fp4_e2m1")
    with pytest.raises(ValueError, match="unpack_fp4"):
        dequantize_mx(torch.full((4, 64), 0x21, dtype=torch.uint8), scales, "fp4_e2m1")
    with pytest.raises(ValueError, match=r"shape \(4, 32\).*n=70"):
        unpack_fp4(pack_fp4(codes), 70)
    with pytest.raises(ValueError, match="4-bit"):
        pack_fp4(torch.tensor([16], dtype=torch.uint8))


@pytest.mark.parametrize("shape", [(3, 64), (2, 5, 96)])
def test_packed_fp4_dequantize_equals_unpack_then_dequantize(shape):
    n = shape[-1]
    g = torch.Generator().manual_seed(3)
    packed = torch.randint(0, 256, (*shape[:-1], n // 2), dtype=torch.uint8, generator=g)
    scales = torch.randint(100, 160, (*shape[:-1], n // 32), dtype=torch.uint8, generator=g)
    scales.view(-1)[0] = 0xFF  # a NaN block
    for s in (scales, scales.clone().fill_(3), scales.clone().fill_(250)):  # fast path and both fallbacks
        for dtype in (torch.float32, torch.bfloat16):
            want = dequantize_mx(unpack_fp4(packed, n), s, "fp4_e2m1", dtype=dtype)
            got = dequantize_fp4_packed(packed, s, n, dtype=dtype)
            assert got.dtype == dtype and bool(got.isnan().any()) == bool((s == 0xFF).any())
            torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
    with pytest.raises(ValueError, match="uint8"):
        dequantize_fp4_packed(packed.float(), scales, n)
