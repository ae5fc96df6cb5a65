"""safetensors files at the byte level: header parsing with integrity checks, streaming writer,
atomic (temp name + fsync + rename) file replacement.

A safetensors file is ``u64 little-endian header length N | N bytes of JSON | data``; the JSON maps
each tensor name to ``{"dtype", "shape", "data_offsets": [begin, end]}`` relative to the data
start, plus an optional ``"__metadata__"`` dict of strings. Reading the header alone gives names,
shapes and dtypes without touching tensor data (``k3 inspect``, meta-device loading).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import struct
from dataclasses import dataclass
from typing import Iterable

import torch

from k3.errors import CheckpointError  # re-exported as k3.checkpoint.io.CheckpointError

__all__ = ["CheckpointError", "TensorInfo", "read_header", "write_safetensors", "write_json_atomic",
           "parse_size", "sha256_file", "DTYPES", "DTYPE_NAMES"]

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
_MAX_HEADER = 100 * 1024 * 1024
_HASH_CHUNK = 8 * 1024 * 1024

@dataclass(frozen=True)
class TensorInfo:
    file: str
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def read_header(path: str) -> dict[str, TensorInfo]:
    """Parse and check one safetensors header; raise :class:`CheckpointError` naming the file.

    Checks that the header is valid JSON of the right structure, that every tensor's byte range
    matches its shape and dtype and lies inside the file (a truncated file fails here).
    """
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{path}: truncated or not a safetensors file ({size} bytes)")
            (n,) = struct.unpack("<Q", head)
            if n > _MAX_HEADER or 8 + n > size:
                raise CheckpointError(f"{path}: corrupt or truncated safetensors header "
                                      f"(header length {n}, file size {size})")
            raw = f.read(n)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: file not found") from None
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: corrupt safetensors header ({e})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: corrupt safetensors header (not a JSON object)")
    data_size = size - 8 - n
    out: dict[str, TensorInfo] = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = DTYPES[meta["dtype"]]
            shape = tuple(int(s) for s in meta["shape"])
            begin, end = (int(x) for x in meta["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{path}: tensor {name!r}: corrupt header entry {meta!r}") from None
        nbytes = math.prod(shape) * _itemsize(dtype)
        if begin < 0 or end - begin != nbytes:
            raise CheckpointError(f"{path}: tensor {name!r}: byte range {begin}..{end} does not match "
                                  f"shape {list(shape)} {meta['dtype']}")
        if end > data_size:
            raise CheckpointError(f"{path}: truncated: tensor {name!r} ends at byte {8 + n + end} "
                                  f"but the file has {size} bytes")
        out[name] = TensorInfo(path, name, dtype, shape)
    return out


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def write_safetensors(path: str, tensors: Iterable[tuple[str, torch.Tensor]],
                      metadata: dict[str, str] | None = None) -> tuple[int, str]:
    """Stream ``(name, tensor)`` pairs into a safetensors file, fsync it; return (bytes written,
    sha256 hex digest of the whole file, computed from the bytes as they are written).

    Tensors are written one at a time from their own storage (no whole-shard copy in memory). An
    OSError while writing (ENOSPC, EROFS, ...) carries ``path``.
    """
    items = [(n, t.detach()) for n, t in tensors]
    header: dict[str, object] = {"__metadata__": {"format": "pt", **(metadata or {})}}
    offset = 0
    for name, t in items:
        nbytes = t.numel() * t.element_size()
        header[name] = {"dtype": DTYPE_NAMES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # data start aligned to 8 bytes, as the safetensors writer does
    digest = hashlib.sha256()
    try:
        with open(path, "wb") as f:
            for chunk in (struct.pack("<Q", len(raw)), raw):
                f.write(chunk)
                digest.update(chunk)
            for _, t in items:
                if t.numel():
                    view = memoryview(t.cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
                    f.write(view)
                    digest.update(view)
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        if e.filename is None:
            raise OSError(e.errno, e.strerror, path) from None
        raise
    return 8 + len(raw) + offset, digest.hexdigest()


def sha256_file(path: str) -> str:
    """sha256 hex digest of a file, read in 8 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def write_json_atomic(path: str, obj: object, tmp_path: str | None = None) -> str:
    """Write JSON to ``tmp_path`` (default ``path`` + ``.tmp``) and fsync it; return the temp path.

    The caller renames it into place (``os.replace``) when its commit point comes.
    """
    tmp = tmp_path or path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    return tmp


_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B)?\s*$", re.IGNORECASE)
_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(size: int | str) -> int:
    """``"2GB"`` -> 2·10⁹ bytes, ``"512MiB"`` -> 512·2²⁰ (HF convention); ints pass through."""
    if isinstance(size, int) and not isinstance(size, bool):
        n = size
    else:
        m = _SIZE_RE.match(str(size))
        if not m:
            raise ValueError(f"max_shard_size must look like '2GB' or '500MiB', got {size!r}")
        n = int(float(m.group(1)) * _UNITS[(m.group(2) or "B").upper()])
    if n <= 0:
        raise ValueError(f"max_shard_size must be > 0, got {size!r}")
    return n
