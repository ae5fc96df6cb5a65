"""Image preprocessing (SPEC §3.9) against the research note's vectors and by-hand arithmetic.

Patch order is checked by index arithmetic written here (patch k = grid row k // gw, column
k % gw), not by the module's reshape; every refusal has a positive control beside it.
"""

from __future__ import annotations

import base64
import io
import struct
import zlib

import numpy as np
import pytest
import torch
from PIL import Image

from k3.data.images import (MAX_IMAGE_PIXELS, TRANSPARENT_BG, load_image, open_image, preprocess,
                            to_rgb)
from k3.errors import K3Error
from k3.config.vision import ImageProcConfig

PROC = ImageProcConfig()
P = PROC.patch_size


def _png_bytes(im: Image.Image, fmt: str = "PNG") -> bytes:
    buf = io.BytesIO()
    im.save(buf, fmt)
    return buf.getvalue()


def _header_only_png(w: int, h: int) -> bytes:
    """A PNG signature + IHDR (w × h, RGB8) + IEND: the header claims the size, no pixel data."""
    def chunk(tag, data):
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data))
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)) + chunk(b"IEND", b"")


def _unpatchify(pv: torch.Tensor, gh: int, gw: int) -> np.ndarray:
    """[gh·gw, 3, p, p] -> [gh·p, gw·p, 3] by explicit index arithmetic (patch k at row k//gw, col k%gw)."""
    p = pv.shape[-1]
    out = np.zeros((gh * p, gw * p, 3), np.float32)
    for k in range(gh * gw):
        r, c = divmod(k, gw)
        out[r * p:(r + 1) * p, c * p:(c + 1) * p] = pv[k].permute(1, 2, 0).numpy()
    return out


def _norm(u8) -> np.ndarray:
    return (np.asarray(u8, np.float64) / 255 - 0.5) / 0.5


# --------------------------------------------------------------------------- size rule (§7 vectors)
# (W, H) -> (new_w, new_h), grid_thw, tokens; research/vision_moonvit.md §7
VECTORS = [
    ((310, 470), (310, 470), (1, 34, 24), 204),
    ((7300, 30), (7168, 29), (1, 4, 512), 512),
    ((13, 9), (13, 9), (1, 2, 2), 1),
    ((4000, 3000), (4000, 3000), (1, 216, 286), 15444),
    ((10000, 100), (7168, 71), (1, 6, 512), 768),
    ((8000, 8000), (3586, 3586), (1, 258, 258), 16641),
    ((100, 100), (100, 100), (1, 8, 8), 16),
    ((30, 16), (30, 16), (1, 2, 4), 2),
    ((60, 60), (60, 60), (1, 6, 6), 9),
]


@pytest.mark.parametrize("size,new,grid,tokens", VECTORS, ids=[f"{w}x{h}" for (w, h), *_ in VECTORS])
def test_size_rule_vectors_through_preprocess(size, new, grid, tokens):
    im = Image.new("L", size, 255)                       # white: the resized area reads back as +1
    pv, grids, sizes = preprocess([im], PROC)
    assert grids.dtype == torch.int64 and grids.tolist() == [list(grid)]
    assert sizes == [size]
    assert pv.shape == (grid[1] * grid[2], 3, P, P) and pv.dtype == torch.float32
    assert PROC.num_tokens(*size) == tokens == (grid[1] // 2) * (grid[2] // 2)
    img = _unpatchify(pv, grid[1], grid[2])
    nw, nh = new
    assert np.all(img[:nh, :nw] == 1.0)                  # the resized image, white throughout
    assert np.all(img[nh:] == -1.0) and np.all(img[:, nw:] == -1.0)   # black padding, right/bottom only


def test_resize_is_pil_bicubic_never_up():
    proc = ImageProcConfig(in_patch_limit=16)            # 112×112 = 64 patches -> scale 0.5 -> 56×56
    rng = np.random.default_rng(0)
    arr = rng.integers(0, 256, (112, 112, 3), dtype=np.uint8)
    pv, grids, _ = preprocess([Image.fromarray(arr)], proc)
    assert grids.tolist() == [[1, 4, 4]]
    want = np.asarray(Image.fromarray(arr).resize((56, 56), Image.Resampling.BICUBIC))
    np.testing.assert_allclose(_unpatchify(pv, 4, 4), _norm(want), atol=1e-6)
    small = rng.integers(0, 256, (20, 30, 3), dtype=np.uint8)    # under every limit: no resize at all
    pv, grids, _ = preprocess([Image.fromarray(small)], proc)
    np.testing.assert_allclose(_unpatchify(pv, *grids[0, 1:].tolist())[:20, :30], _norm(small), atol=1e-6)


# --------------------------------------------------------------------------- pixels
def test_padding_black_right_bottom_and_red_blue_vector():
    # research note §7: 30×16, left half red, right half blue; patch 2 has blue at x = 28, 29, then pad
    arr = np.zeros((16, 30, 3), np.uint8)
    arr[:, :15] = (255, 0, 0)
    arr[:, 15:] = (0, 0, 255)
    pv, grids, _ = preprocess([Image.fromarray(arr)], PROC)
    assert grids.tolist() == [[1, 2, 4]]
    p2 = pv[2].permute(1, 2, 0).numpy()                  # [14, 14, 3], x = 28 … 41, y = 0 … 13
    assert np.all(p2[:, :2] == np.array([-1, -1, 1], np.float32))
    assert np.all(p2[:, 2:] == -1.0)                      # padding = normalized 0
    p0 = pv[0].permute(1, 2, 0).numpy()
    assert np.all(p0[:, :14] == np.array([1, -1, -1], np.float32))   # pure red -> (1, −1, −1)
    img = _unpatchify(pv, 2, 4)
    assert np.all(img[16:] == -1.0) and np.all(img[:, 30:] == -1.0)
    assert not np.all(img[:16, :30] == -1.0, axis=-1).any()   # no picture pixel reads as padding


def test_normalization_by_hand_follows_config():
    colour = (10, 128, 250)
    im = Image.new("RGB", (14, 14), colour)
    pv, _, _ = preprocess([im], PROC)                     # K3: 2·u8/255 − 1
    img = _unpatchify(pv, 2, 2)
    np.testing.assert_allclose(img[0, 0], [2 * v / 255 - 1 for v in colour], atol=1e-6)
    proc = ImageProcConfig(image_mean=[0.1, 0.2, 0.3], image_std=[0.2, 0.3, 0.4])
    pv, _, _ = preprocess([im], proc)
    want = [(v / 255 - m) / s for v, m, s in zip(colour, (0.1, 0.2, 0.3), (0.2, 0.3, 0.4))]
    img = _unpatchify(pv, 2, 2)
    np.testing.assert_allclose(img[:14, :14], np.broadcast_to(want, (14, 14, 3)), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(img[14:, 14:], np.broadcast_to([-0.1 / 0.2, -0.2 / 0.3, -0.3 / 0.4], (14, 14, 3)),
                               rtol=1e-6)                  # padding: normalized black under this config


def test_patch_order_frame_major_row_major_chw():
    H, W = 56, 84                                          # grid 4 × 6, no padding
    y, x = np.mgrid[0:H, 0:W]
    arr = np.stack([y, x, (7 * y + 3 * x) % 256], -1).astype(np.uint8)
    pv, grids, _ = preprocess([Image.fromarray(arr)], PROC)
    assert grids.tolist() == [[1, 4, 6]]
    u8 = np.rint((pv.numpy() * 0.5 + 0.5) * 255).astype(int)         # [24, 3, 14, 14]
    for k in range(24):
        gy, gx = k // 6, k % 6
        for i in range(0, P, 5):
            for j in range(0, P, 3):
                row, col = gy * P + i, gx * P + j
                assert u8[k, 0, i, j] == row and u8[k, 1, i, j] == col          # channel 0 = R = row
                assert u8[k, 2, i, j] == (7 * row + 3 * col) % 256


def test_packing_equals_each_alone():
    rng = np.random.default_rng(1)
    a = Image.fromarray(rng.integers(0, 256, (40, 70, 3), dtype=np.uint8))
    b = Image.fromarray(rng.integers(0, 256, (90, 20, 3), dtype=np.uint8))
    pv, grids, sizes = preprocess([a, b], PROC)
    pa, ga, _ = preprocess([a], PROC)
    pb, gb, _ = preprocess([b], PROC)
    assert torch.equal(pv, torch.cat([pa, pb])) and torch.equal(grids, torch.cat([ga, gb]))
    assert sizes == [(70, 40), (20, 90)] and grids.tolist() == [[1, 4, 6], [1, 8, 2]]
    assert pv.shape[0] == int(grids.prod(1).sum())
    pv0, g0, s0 = preprocess([], PROC)
    assert pv0.shape == (0, 3, P, P) and g0.shape == (0, 3) and s0 == []


def test_output_feeds_the_vision_model():
    from k3.model.vision import VisionModel
    from k3.config.presets import vision_preset
    vc = vision_preset("nano")
    if vc is None:
        pytest.skip("nano preset has no vision tower")
    rng = np.random.default_rng(2)
    ims = [Image.fromarray(rng.integers(0, 256, (30, 44, 3), dtype=np.uint8)), Image.new("RGB", (13, 9))]
    pv, grids, _ = preprocess(ims, PROC)
    with torch.no_grad():
        out = VisionModel(vc)(pv, grids)
    assert out.shape == (sum(PROC.num_tokens(*im.size) for im in ims), vc.text_hidden_size)


# --------------------------------------------------------------------------- transparency
def test_transparency_chessboard_vectors():
    rgba = np.zeros((16, 16, 4), np.uint8)                 # fully transparent …
    rgba[:, :, :3] = 40
    rgba[2, 1] = (40, 40, 40, 128)                         # half on a white cell
    rgba[2, 9] = (40, 40, 40, 128)                         # half on a gray cell (x // 8 = 1)
    rgba[10, 10] = (7, 8, 9, 255)                          # opaque
    out = np.asarray(load_image(Image.fromarray(rgba, "RGBA")))
    assert tuple(out[0, 0]) == (255, 255, 255) and tuple(out[0, 8]) == (180, 180, 180)
    assert tuple(out[8, 0]) == (180, 180, 180) and tuple(out[8, 8]) == (255, 255, 255)
    assert tuple(out[2, 1]) == (147, 147, 147) and tuple(out[2, 9]) == (109, 109, 109)
    assert tuple(out[10, 10]) == (7, 8, 9)
    assert TRANSPARENT_BG.square == 8 and TRANSPARENT_BG.gray == 180
    rgb = Image.new("RGB", (3, 3), (1, 2, 3))
    assert to_rgb(rgb) is rgb                              # RGB passes through untouched
    assert np.asarray(to_rgb(Image.new("L", (3, 3), 77))).tolist() == [[[77] * 3] * 3] * 3


def test_transparency_filled_after_resize():
    proc = ImageProcConfig(in_patch_limit=16)              # 112² -> 56²: the board is drawn at 56²
    clear = Image.new("RGBA", (112, 112), (0, 0, 0, 0))
    pv, grids, _ = preprocess([clear], proc)
    img = _unpatchify(pv, 4, 4)
    np.testing.assert_allclose(img[0, 8], _norm([180] * 3), atol=1e-6)   # cell (1, 0) of the 56² board
    np.testing.assert_allclose(img[0, 0], _norm([255] * 3), atol=1e-6)
    np.testing.assert_allclose(img[8, 8], _norm([255] * 3), atol=1e-6)


# --------------------------------------------------------------------------- sources
def test_data_url_bytes_and_path_load_the_same(tmp_path):
    rng = np.random.default_rng(3)
    im = Image.fromarray(rng.integers(0, 256, (20, 33, 3), dtype=np.uint8))
    data = _png_bytes(im)
    f = tmp_path / "a.png"
    f.write_bytes(data)
    url = "data:image/png;base64," + base64.b64encode(data).decode()
    ref = np.asarray(load_image(f))
    assert np.array_equal(ref, np.asarray(im))
    for src in (str(f), data, url):
        assert np.array_equal(np.asarray(load_image(src)), ref)
    assert np.array_equal(np.asarray(load_image("a.png", base_dir=tmp_path)), ref)
    jpg = _png_bytes(im, "JPEG")
    (tmp_path / "a.jpg").write_bytes(jpg)
    jurl = "data:image/jpeg;base64," + base64.b64encode(jpg).decode()
    assert np.array_equal(np.asarray(load_image(jurl)), np.asarray(load_image(tmp_path / "a.jpg")))
    p1, g1, _ = preprocess([url], PROC)
    p2, g2, _ = preprocess([f], PROC)
    assert torch.equal(p1, p2) and torch.equal(g1, g2)


def test_refuses_corrupt_bytes():
    good = _png_bytes(Image.new("RGB", (40, 40), (9, 9, 9)))
    assert load_image(good).size == (40, 40)                               # control
    with pytest.raises(K3Error, match="corrupt"):
        load_image(b"this is not an image at all")
    with pytest.raises(K3Error, match="corrupt"):
        load_image(good[:60])                                              # truncated PNG
    with pytest.raises(K3Error, match="empty"):
        load_image(b"")
    with pytest.raises(K3Error, match="corrupt base64"):
        load_image("data:image/png;base64,@@@not-base64@@@")
    with pytest.raises(K3Error, match="cannot read the file"):
        load_image("/nonexistent/dir/x.png")


def test_refuses_remote_urls(tmp_path):
    f = tmp_path / "x.png"
    f.write_bytes(_png_bytes(Image.new("RGB", (5, 5))))
    assert load_image(str(f)).size == (5, 5)                                # control
    for url in ("http://example.com/x.png", "https://example.com/x.png", "HTTPS://EXAMPLE.COM/X.PNG"):
        with pytest.raises(K3Error, match="no network"):
            load_image(url)
    with pytest.raises(K3Error, match="unsupported URL scheme"):
        load_image("ftp://example.com/x.png")


def test_unsupported_types_refused_gif_bmp_webp_accepted():
    im = Image.new("RGB", (12, 10), (200, 10, 10))
    for fmt in ("GIF", "BMP", "WEBP", "JPEG", "PNG"):                      # controls: accepted
        assert load_image(_png_bytes(im, fmt)).size == (12, 10)
    for fmt in ("TIFF", "PPM", "ICO"):
        with pytest.raises(K3Error, match=f"unsupported image type {fmt}"):
            load_image(_png_bytes(im, fmt))
    data = base64.b64encode(_png_bytes(im)).decode()
    assert load_image("data:image/webp;base64," + data).size == (12, 10)   # the bytes decide the format
    with pytest.raises(K3Error, match="unsupported data URL type image/svg"):
        load_image("data:image/svg+xml;base64," + data)
    with pytest.raises(K3Error, match="data:image/<type>;base64"):
        load_image("data:text/plain;base64," + data)
    with pytest.raises(K3Error, match="only base64"):
        load_image("data:image/png," + data)
    with pytest.raises(K3Error, match="must be a path"):
        load_image(12345)


def test_refuses_zero_size():
    assert load_image(Image.new("RGB", (1, 5))).size == (1, 5)              # control
    for size in ((0, 5), (5, 0)):
        with pytest.raises(K3Error, match="zero-size"):
            load_image(Image.new("RGB", size))
        with pytest.raises(K3Error, match="zero-size"):
            preprocess([Image.new("RGB", size)], PROC)


def test_refuses_too_many_pixels_before_decoding():
    assert MAX_IMAGE_PIXELS == 8192 * 8192
    # a 9000 × 9000 header with no pixel data: refused on the header's size, never decoded
    with pytest.raises(K3Error, match=f"over the limit of {MAX_IMAGE_PIXELS} pixels"):
        load_image(_header_only_png(9000, 9000))
    with pytest.raises(K3Error, match="corrupt"):                          # control: under the limit it
        load_image(_header_only_png(8192, 8192))                           # gets to decoding (and fails)
    data = _png_bytes(Image.new("RGB", (30, 20)))
    assert open_image(data, max_pixels=600).size == (30, 20)               # control: exactly at the limit
    with pytest.raises(K3Error, match="600 pixels"):
        open_image(data, max_pixels=599)
    with pytest.raises(K3Error, match="over the limit"):
        preprocess([data], PROC, max_pixels=599)
