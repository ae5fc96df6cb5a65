"""Image loading and preprocessing for the vision tower (SPEC §3.9; research/vision_moonvit.md §1).

Release facts followed (K3 ``media_utils.py`` / ``KimiK3VisionProcessor``, "after_resize" stage):

1. size: :meth:`ImageProcConfig.resize_size` — scale = min(1, √(in_patch_limit / patches),
   max_side/W, max_side/H), never up, ``int()`` truncation;
2. resize: ``PIL.Image.resize((new_w, new_h), BICUBIC)`` in the image's **own mode** (PIL itself
   uses NEAREST for modes "P" and "1"); skipped when the size is unchanged (PIL returns a copy);
3. to RGB (:func:`to_rgb`, after the resize): an RGB image as is; no alpha band and no
   ``transparency`` info -> ``convert("RGB")``; otherwise RGBA composited over a chessboard of the
   resized size, ``uint8(α·rgb + (1 − α)·bg)`` in float32, α = A/255, truncating;
   :data:`TRANSPARENT_BG` holds the board (8-px cells, white 255 top-left, gray 180);
4. pad with 0 (black, uint8) on the right and bottom to ``proc.pad_multiple`` (28 px);
5. normalize ``x = float32(u8/255); x -= mean; x *= 1/std`` (K3: mean = std = 0.5 -> 2·u8/255 − 1);
6. patchify (1, Hp, Wp, 3) -> [gh·gw, 3, p, p]: row-major over the patch grid, CHW per patch;
7. pack: several images' patches one after another, ``grid_thws`` [n, 3] int64 rows (1, gh, gw).

Not in the release, this module's own choices: sources are a path, raw bytes, a base64 ``data:``
URL or a PIL image; http(s) URLs are refused (no network); only the formats in
:data:`SUPPORTED_FORMATS` are decoded (others, e.g. TIFF, EPS, ICO, are refused by name); an
animated GIF or WebP gives its first frame (PIL's default, as the release); no EXIF rotation (the
release has none); images over ``max_pixels`` (default :data:`MAX_IMAGE_PIXELS`) are refused from
the file header, before any decoding. The token count of an image is
:meth:`ImageProcConfig.num_tokens` (one rule, in one place).
"""

from __future__ import annotations

import base64
import binascii
import io
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Union

import numpy as np
import torch
from PIL import Image

from k3.errors import K3Error
from k3.config.vision import ImageProcConfig

__all__ = ["load_image", "open_image", "to_rgb", "preprocess", "TransparentBg", "TRANSPARENT_BG",
           "MAX_IMAGE_PIXELS", "SUPPORTED_FORMATS"]

ImageSource = Union[str, os.PathLike, bytes, bytearray, Image.Image]

# 8192 × 8192: a decompression-bomb guard, checked on the header's size before decoding. K3 keeps
# at most 65536 patches (≈ 12.8 MP) anyway; this bounds the decode itself (≈ 200 MB as RGB).
MAX_IMAGE_PIXELS = 8192 * 8192
SUPPORTED_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
_DATA_URL_TYPES = {"png": "PNG", "jpeg": "JPEG", "jpg": "JPEG", "webp": "WEBP", "gif": "GIF", "bmp": "BMP"}
_URL_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")


@dataclass(frozen=True)
class TransparentBg:
    """The chessboard a transparent image is composited on (``transparent_bg_config``): cell (x, y)
    in ``square``-px units is ``gray`` iff (x + y) is odd when ``top_left_white``, else ``white``."""

    square: int = 8
    top_left_white: bool = True
    white: int = 255
    gray: int = 180


# K3's media_proc_cfg.transparent_bg_config (research note §1; ImageProcConfig has no such field)
TRANSPARENT_BG = TransparentBg()


def _refuse(what: str, problem: str) -> K3Error:
    return K3Error(f"image {what}: {problem}")


def _describe(source) -> str:
    if isinstance(source, (bytes, bytearray)):
        return f"<{len(source)} bytes>"
    s = str(source)
    return repr(s[:60] + "…") if len(s) > 60 else repr(s)


def _read_source(source, base_dir) -> bytes:
    """Path / bytes / data URL -> the encoded bytes (no decoding yet)."""
    if isinstance(source, (bytes, bytearray)):
        return bytes(source)
    if isinstance(source, os.PathLike):
        source = os.fspath(source)
    if not isinstance(source, str):
        raise K3Error(f"image source must be a path, bytes, a data: URL or a PIL image, got "
                      f"{type(source).__name__}")
    what = _describe(source)
    if source.startswith("data:"):
        head, comma, payload = source.partition(",")
        m = re.fullmatch(r"data:image/([A-Za-z0-9.+-]+)((?:;[^;,]*)*)", head)
        if not comma or m is None:
            raise _refuse(what, "a data URL must read data:image/<type>;base64,<data>")
        if m.group(1).lower() not in _DATA_URL_TYPES:
            raise _refuse(what, f"unsupported data URL type image/{m.group(1)} (supported: "
                                f"{', '.join('image/' + t for t in _DATA_URL_TYPES)})")
        if ";base64" not in m.group(2).lower():
            raise _refuse(what, "only base64 data URLs are accepted (';base64,' missing)")
        try:
            return base64.b64decode(re.sub(r"\s+", "", payload), validate=True)
        except (binascii.Error, ValueError) as e:
            raise _refuse(what, f"corrupt base64 payload ({e})") from None
    m = _URL_SCHEME.match(source)
    if m:
        if m.group(1).lower() in ("http", "https"):
            raise _refuse(what, "remote URLs are not fetched (k3 has no network access): download "
                                "the file and pass its path, or send a data:image/...;base64 URL")
        raise _refuse(what, f"unsupported URL scheme {m.group(1)}:// (a path, bytes or a data: URL)")
    path = Path(source)
    if base_dir is not None and not path.is_absolute():
        path = Path(base_dir) / path
    try:
        return path.read_bytes()
    except OSError as e:
        raise _refuse(repr(str(path)), f"cannot read the file ({e.strerror or e})") from None


def _check_size(im: Image.Image, what: str, max_pixels: int) -> None:
    w, h = im.size
    if w < 1 or h < 1:
        raise _refuse(what, f"zero-size image ({w}x{h})")
    if w * h > max_pixels:
        raise _refuse(what, f"{w}x{h} = {w * h} pixels is over the limit of {max_pixels} pixels "
                            "(decompression-bomb guard, max_pixels)")


def open_image(source: ImageSource, *, max_pixels: int = MAX_IMAGE_PIXELS,
               base_dir: str | os.PathLike | None = None) -> Image.Image:
    """A decoded PIL image in its **file's own mode** (RGBA, P, L, ... kept for the release's
    resize-then-fill order). ``source``: a file path (relative ones under ``base_dir`` when given),
    raw bytes, a ``data:image/<png|jpeg|webp|gif|bmp>;base64,...`` URL, or a PIL image (returned
    after the size checks). Raises K3Error naming the problem: unreadable file, http(s) URL,
    corrupt bytes, a format not in :data:`SUPPORTED_FORMATS`, zero size, over ``max_pixels``."""
    if isinstance(source, Image.Image):
        _check_size(source, f"<PIL {source.mode} image>", max_pixels)
        return source
    what = _describe(source)
    data = _read_source(source, base_dir)
    if not data:
        raise _refuse(what, "empty data (0 bytes)")
    try:
        im = Image.open(io.BytesIO(data))
    except Image.DecompressionBombError as e:
        raise _refuse(what, f"over the pixel limit ({e})") from None
    except (OSError, SyntaxError, ValueError, EOFError) as e:
        raise _refuse(what, f"corrupt or unrecognised image data ({type(e).__name__}: {e})") from None
    if im.format not in SUPPORTED_FORMATS:
        raise _refuse(what, f"unsupported image type {im.format} (supported: {', '.join(SUPPORTED_FORMATS)})")
    _check_size(im, what, max_pixels)
    try:
        im.load()
    except Exception as e:  # noqa: BLE001 — PIL decoders raise OSError, SyntaxError, struct.error, ...
        raise _refuse(what, f"corrupt {im.format} data ({type(e).__name__}: {e})") from None
    return im


def to_rgb(im: Image.Image, bg: TransparentBg = TRANSPARENT_BG) -> Image.Image:
    """The release's ``fill_transparent_bg_with``: RGB as is; no alpha band and no
    ``transparency`` info -> ``convert("RGB")``; else alpha-composite over ``bg``'s chessboard of
    the image's size, ``uint8(α·rgb + (1 − α)·board)`` (float32, truncated)."""
    if im.mode == "RGB":
        return im
    if "A" not in im.getbands() and "transparency" not in im.info:
        return im.convert("RGB")
    rgba = np.asarray(im.convert("RGBA"))
    h, w = rgba.shape[:2]
    cell = (np.arange(h)[:, None] // bg.square + np.arange(w)[None, :] // bg.square) % 2
    board = np.where(cell == (1 if bg.top_left_white else 0), bg.gray, bg.white).astype(np.uint8)
    a = rgba[:, :, 3:4].astype(np.float32) / 255.0
    out = a * rgba[:, :, :3] + (1 - a) * board[:, :, None]
    return Image.fromarray(out.astype(np.uint8), "RGB")


def load_image(source: ImageSource, *, max_pixels: int = MAX_IMAGE_PIXELS,
               base_dir: str | os.PathLike | None = None, bg: TransparentBg = TRANSPARENT_BG) -> Image.Image:
    """:func:`open_image` then :func:`to_rgb`: an RGB PIL image (transparency on the chessboard).
    :func:`preprocess` instead fills after the resize, as the release does."""
    return to_rgb(open_image(source, max_pixels=max_pixels, base_dir=base_dir), bg)


def _image_patches(im: Image.Image, proc: ImageProcConfig, bg: TransparentBg) -> tuple[np.ndarray, tuple]:
    """One image -> (patches [gh·gw, 3, p, p] float32, (1, gh, gw))."""
    W, H = im.size
    new_w, new_h = proc.resize_size(W, H)
    if (new_w, new_h) != (W, H):
        im = im.resize((new_w, new_h), resample=Image.Resampling.BICUBIC)
    rgb = np.asarray(to_rgb(im, bg), dtype=np.uint8)
    t, gh, gw = proc.grid_thw(W, H)
    p = proc.patch_size
    padded = np.zeros((gh * p, gw * p, 3), np.uint8)                   # black, right and bottom
    padded[:new_h, :new_w] = rgb
    x = (padded / 255.0).astype(np.float32)
    x -= np.asarray(proc.image_mean, np.float32)
    x *= 1.0 / np.asarray(proc.image_std, np.float32)
    patches = x.reshape(gh, p, gw, p, 3).transpose(0, 2, 4, 1, 3).reshape(gh * gw, 3, p, p)
    return patches, (t, gh, gw)


def preprocess(images: Iterable[ImageSource], proc: ImageProcConfig, *,
               max_pixels: int = MAX_IMAGE_PIXELS, base_dir: str | os.PathLike | None = None,
               bg: TransparentBg = TRANSPARENT_BG) -> tuple[torch.Tensor, torch.Tensor, list[tuple[int, int]]]:
    """Images (sources as :func:`open_image` takes them) -> the vision tower's packed input.

    Returns ``pixel_values`` [N, 3, p, p] float32 (N = Σ gh·gw; each image's patches row-major over
    its grid, images one after another), ``grid_thws`` [n, 3] int64 (rows (1, gh, gw)) and
    ``sizes`` — each image's original (W, H), which the prompt's ``image {W}x{H}`` text uses.
    """
    parts, grids, sizes = [], [], []
    for src in images:
        im = open_image(src, max_pixels=max_pixels, base_dir=base_dir)
        patches, grid = _image_patches(im, proc, bg)
        parts.append(patches)
        grids.append(grid)
        sizes.append(im.size)
    p = proc.patch_size
    pixel_values = torch.from_numpy(np.concatenate(parts)) if parts else torch.zeros(0, 3, p, p)
    grid_thws = torch.tensor(grids, dtype=torch.int64).reshape(-1, 3)
    return pixel_values, grid_thws, sizes
