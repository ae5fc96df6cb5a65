"""Disaggregated prefill / decode (SPEC §6.5): the state message, transports and the two workers.

Message layout (one ``bytes``)::

    b"K3ST" | version u16 | header length u32 | header (UTF-8 JSON) | tensor bytes, in header order

All integers big-endian. The header holds the config fingerprint hash (sha256 of
``config.fingerprint()``), the byte order, batch size, sequence length, the kind of every layer
(``kda``/``mla``) with its tensors' names, dtypes and shapes, and a free ``meta`` dict. Per layer:

* KDA: ``conv`` [B, 3P, K−1] and ``recurrent`` [B, nh, d, d] (absent while the state is empty);
* MLA: ``c`` [B, T, kv_lora_rank] and ``k_pe`` [B, T, qk_rope_head_dim] (absent when T = 0).

So the tensor bytes of a batch-1 message after T tokens are
``n_kda·(3P(K−1)·s_conv + nh·d²·4) + n_mla·T·(r + rope)·s_kv``, s the element sizes.

The prefill side runs the first N−1 prompt tokens and sends their state with the last token; the
decode side feeds that token first, so every prompt token is seen exactly once.
"""

from __future__ import annotations

import hashlib
import json
import queue
import socket
import struct
import sys
from typing import Sequence

import torch

from k3.errors import K3Error
from k3.model.cache import K3Cache, KDAState

__all__ = ["TransferError", "encode_state", "decode_state", "decode_message", "config_hash",
           "InProcessTransport", "SocketTransport", "SocketListener", "PrefillWorker", "DecodeWorker"]

MAGIC, VERSION = b"K3ST", 1
_PREFIX = struct.Struct(">4sHI")
_FRAME = struct.Struct(">Q")
_DTYPES = {str(d).removeprefix("torch."): d for d in
           (torch.float32, torch.float16, torch.bfloat16, torch.float64)}


class TransferError(K3Error):
    """A state message or transport that cannot be used: bad magic/version/config, truncation."""


def config_hash(config) -> str:
    """sha256 of the config fingerprint: what a message's sender and receiver must share."""
    return hashlib.sha256(json.dumps(config.fingerprint()).encode()).hexdigest()


def _layer_tensors(cfg, l: int, st) -> list[tuple[str, torch.Tensor]]:
    if cfg.is_kda_layer(l):
        pairs = [("conv", st.conv), ("recurrent", st.recurrent)]
    else:
        pairs = [("c", st.c), ("k_pe", st.k_pe)] if st.length else []
    return [(n, t) for n, t in pairs if t is not None]


def encode_state(cache: K3Cache, config, *, meta: dict | None = None) -> bytes:
    """Serialise every layer's state of ``cache`` (rows of one length) with a versioned header."""
    if not isinstance(cache, K3Cache):
        raise TransferError(f"encode_state: cache must be a K3Cache, got {type(cache).__name__}")
    if cache.fingerprint != config.fingerprint():
        raise TransferError("encode_state: cache was built for a different config")
    layers, blobs = [], []
    for l, st in enumerate(cache.layers):
        entry = {"kind": "kda" if config.is_kda_layer(l) else "mla", "tensors": []}
        for name, t in _layer_tensors(config, l, st):
            t = t.detach().contiguous().cpu()
            entry["tensors"].append({"name": name, "dtype": str(t.dtype).removeprefix("torch."),
                                     "shape": list(t.shape)})
            blobs.append(t.view(torch.uint8).numpy().tobytes())
        layers.append(entry)
    header = json.dumps({"fingerprint": config_hash(config), "byteorder": sys.byteorder,
                         "batch_size": cache.batch_size, "seq_len": cache.seq_len,
                         "layers": layers, "meta": meta or {}}).encode()
    return b"".join([_PREFIX.pack(MAGIC, VERSION, len(header)), header, *blobs])


def _read_header(data: bytes, config) -> tuple[dict, int]:
    if len(data) < _PREFIX.size:
        raise TransferError(f"state message truncated: {len(data)} bytes, the prefix alone is {_PREFIX.size}")
    magic, version, hlen = _PREFIX.unpack_from(data)
    if magic != MAGIC:
        raise TransferError(f"not a k3 state message (magic {magic!r}, expected {MAGIC!r})")
    if version != VERSION:
        raise TransferError(f"state message version {version}; this k3 reads version {VERSION}")
    if len(data) < _PREFIX.size + hlen:
        raise TransferError(f"state message truncated inside its header ({len(data)} bytes)")
    try:
        header = json.loads(data[_PREFIX.size:_PREFIX.size + hlen])
    except ValueError as e:
        raise TransferError(f"state message header is not valid JSON: {e}") from None
    if header.get("fingerprint") != config_hash(config):
        raise TransferError("state message was encoded for a different model config "
                            f"(fingerprint {str(header.get('fingerprint'))[:12]}…, this model's "
                            f"{config_hash(config)[:12]}…)")
    if header.get("byteorder") != sys.byteorder:
        raise TransferError(f"state message byteorder {header.get('byteorder')!r}, this machine's {sys.byteorder!r}")
    return header, _PREFIX.size + hlen


def _expected_shapes(config, l: int, B: int, T: int) -> dict[str, list[int]]:
    if config.is_kda_layer(l):
        lac = config.linear_attn_config
        nh, d, K = lac.num_heads, lac.head_dim, lac.short_conv_kernel_size
        return {"conv": [B, 3 * nh * d, K - 1], "recurrent": [B, nh, d, d]}
    return {"c": [B, T, config.kv_lora_rank], "k_pe": [B, T, config.qk_rope_head_dim]}


def decode_message(data: bytes, config) -> tuple[K3Cache, dict]:
    """Rebuild the cache (CPU tensors) and the ``meta`` dict of a message from :func:`encode_state`."""
    header, off = _read_header(data, config)
    B, T, layers = header.get("batch_size"), header.get("seq_len"), header.get("layers")
    if not isinstance(B, int) or B < 1 or not isinstance(T, int) or T < 0:
        raise TransferError(f"state message has batch_size={B!r}, seq_len={T!r}")
    if not isinstance(layers, list) or len(layers) != config.num_hidden_layers:
        raise TransferError(f"state message has {len(layers) if isinstance(layers, list) else '?'} "
                            f"layers, the config {config.num_hidden_layers}")
    cache = K3Cache(config, B)
    for l, (entry, st) in enumerate(zip(layers, cache.layers)):
        kind = "kda" if config.is_kda_layer(l) else "mla"
        if entry.get("kind") != kind:
            raise TransferError(f"state message layer {l} is {entry.get('kind')!r}, the config's is {kind!r}")
        want = _expected_shapes(config, l, B, T)
        got = {}
        for spec in entry.get("tensors", []):
            name, dtype = spec.get("name"), _DTYPES.get(spec.get("dtype"))
            if name not in want or name in got or dtype is None or spec.get("shape") != want[name]:
                raise TransferError(f"state message layer {l} tensor {spec} does not fit the config "
                                    f"(expected one of {want}, dtypes {sorted(_DTYPES)})")
            n = dtype.itemsize
            for s in want[name]:
                n *= s
            if off + n > len(data):
                raise TransferError(f"state message truncated in layer {l} {name}: "
                                    f"needs {off + n} bytes, got {len(data)}")
            raw = torch.frombuffer(bytearray(data[off:off + n]), dtype=torch.uint8) if n else torch.empty(0, dtype=torch.uint8)
            got[name] = raw.view(dtype).reshape(want[name])
            off += n
        if got and set(got) != set(want):
            raise TransferError(f"state message layer {l} has tensors {sorted(got)}, needs {sorted(want)}")
        if kind == "kda" and got:
            st.conv, st.recurrent = got["conv"], got["recurrent"]
        elif got:
            st.append(got["c"], got["k_pe"])
        elif kind == "mla" and T:
            raise TransferError(f"state message layer {l} has no KV for seq_len={T}")
    if off != len(data):
        raise TransferError(f"state message has {len(data) - off} bytes after its last tensor")
    cache.seq_len = T
    meta = header.get("meta")
    return cache, meta if isinstance(meta, dict) else {}


def decode_state(data: bytes, config) -> K3Cache:
    """The cache of a message from :func:`encode_state` (see :func:`decode_message`)."""
    return decode_message(data, config)[0]


# ---------------------------------------------------------------------- transports
class InProcessTransport:
    """A queue of messages between two threads of one process (``send`` / ``recv``)."""

    def __init__(self):
        self._q: queue.Queue[bytes] = queue.Queue()
        self.bytes_sent = self.bytes_received = 0

    def send(self, data: bytes) -> None:
        self._q.put(bytes(data))
        self.bytes_sent += len(data)

    def recv(self, timeout: float = 60.0) -> bytes:
        try:
            data = self._q.get(timeout=timeout)
        except queue.Empty:
            raise TransferError(f"no state message within {timeout} s") from None
        self.bytes_received += len(data)
        return data

    def close(self) -> None:
        pass


class SocketTransport:
    """Length-prefixed messages (u64 big-endian length, then the bytes) over a TCP connection.

    ``SocketTransport.listen()`` binds a free loopback port (``listener.port``) and ``accept()``\\ s one
    peer; ``SocketTransport.connect(port)`` is the other end. ``bytes_sent``/``bytes_received``
    count message bytes (the 8-byte frame prefixes excluded).
    """

    def __init__(self, sock: socket.socket, max_message_bytes: int = 1 << 40):
        self._sock, self.max_message_bytes = sock, max_message_bytes
        self.bytes_sent = self.bytes_received = 0

    @staticmethod
    def listen(host: str = "127.0.0.1", port: int = 0) -> "SocketListener":
        return SocketListener(host, port)

    @classmethod
    def connect(cls, port: int, host: str = "127.0.0.1", timeout: float = 30.0) -> "SocketTransport":
        try:
            return cls(socket.create_connection((host, port), timeout=timeout))
        except OSError as e:
            raise TransferError(f"cannot connect to {host}:{port}: {e}") from None

    def send(self, data: bytes) -> None:
        self._sock.sendall(_FRAME.pack(len(data)) + bytes(data))
        self.bytes_sent += len(data)

    def _read(self, n: int, what: str) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            chunk = self._sock.recv(min(n - len(buf), 1 << 20))
            if not chunk:
                raise TransferError(f"connection closed after {len(buf)} of {n} bytes of the {what}")
            buf += chunk
        return bytes(buf)

    def recv(self, timeout: float = 60.0) -> bytes:
        self._sock.settimeout(timeout)
        try:
            (n,) = _FRAME.unpack(self._read(_FRAME.size, "frame length"))
            if n > self.max_message_bytes:
                raise TransferError(f"frame of {n} bytes exceeds max_message_bytes={self.max_message_bytes}")
            data = self._read(n, "message")
        except TimeoutError:
            raise TransferError(f"no complete message within {timeout} s") from None
        self.bytes_received += len(data)
        return data

    def close(self) -> None:
        self._sock.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class SocketListener:
    """A bound, listening socket (port 0 = a free port chosen by the OS, read ``.port``)."""

    def __init__(self, host: str, port: int):
        self._sock = socket.create_server((host, port))
        self.host, self.port = host, self._sock.getsockname()[1]

    def accept(self, timeout: float = 60.0) -> SocketTransport:
        self._sock.settimeout(timeout)
        try:
            conn, _ = self._sock.accept()
        except TimeoutError:
            raise TransferError(f"no peer connected to {self.host}:{self.port} within {timeout} s") from None
        conn.settimeout(None)
        return SocketTransport(conn)

    def close(self) -> None:
        self._sock.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


# ---------------------------------------------------------------------- workers
def _device(model) -> torch.device:
    return next(model.parameters()).device


class PrefillWorker:
    """``prefill(prompt_ids) -> message``: the state after the first N−1 tokens plus the last token.

    The message is also sent on ``transport`` when one is given; ``bytes_sent`` accumulates.
    """

    def __init__(self, model, transport=None, prefill_chunk: int = 512):
        if isinstance(prefill_chunk, bool) or not isinstance(prefill_chunk, int) or prefill_chunk <= 0:
            raise K3Error(f"PrefillWorker: prefill_chunk must be an int > 0, got {prefill_chunk!r}")
        self.model, self.transport, self.prefill_chunk = model, transport, prefill_chunk
        self.bytes_sent = 0

    @torch.no_grad()
    def prefill(self, prompt_ids: Sequence[int]) -> bytes:
        cfg = self.model.config
        ids = [int(t) for t in prompt_ids]
        if not ids:
            raise K3Error("PrefillWorker.prefill: prompt_ids must not be empty")
        bad = [t for t in ids if not 0 <= t < cfg.vocab_size]
        if bad:
            raise K3Error(f"PrefillWorker.prefill: token ids {bad[:5]} outside the vocabulary [0, {cfg.vocab_size})")
        if len(ids) > cfg.max_position_embeddings:
            raise K3Error(f"PrefillWorker.prefill: prompt of {len(ids)} tokens exceeds "
                          f"max_position_embeddings={cfg.max_position_embeddings}")
        cache = K3Cache(cfg, 1)
        dev, head = _device(self.model), ids[:-1]
        for s in range(0, len(head), self.prefill_chunk):
            self.model.model(torch.tensor([head[s:s + self.prefill_chunk]], device=dev), cache)
        message = encode_state(cache, cfg, meta={"last_token": ids[-1], "prompt_len": len(ids)})
        if self.transport is not None:
            self.transport.send(message)
        self.bytes_sent += len(message)
        return message


class DecodeWorker:
    """``decode(message=None, max_tokens) -> token ids``: feed the message's last prompt token, then
    decode greedily (argmax); ``message`` None receives one from ``transport``."""

    def __init__(self, model, transport=None):
        self.model, self.transport = model, transport
        self.bytes_received = 0

    @torch.no_grad()
    def decode(self, message: bytes | None = None, max_tokens: int = 16,
               stop_token_ids: Sequence[int] = ()) -> list[int]:
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens <= 0:
            raise K3Error(f"DecodeWorker.decode: max_tokens must be an int > 0, got {max_tokens!r}")
        if message is None:
            if self.transport is None:
                raise K3Error("DecodeWorker.decode: no message given and no transport to receive one")
            message = self.transport.recv()
        self.bytes_received += len(message)
        cfg = self.model.config
        cache, meta = decode_message(message, cfg)
        last, n = meta.get("last_token"), meta.get("prompt_len")
        if not isinstance(last, int) or not 0 <= last < cfg.vocab_size:
            raise TransferError(f"state message meta last_token={last!r} is not a token id")
        if n != cache.seq_len + 1:
            raise TransferError(f"state message holds {cache.seq_len} tokens of a {n!r}-token prompt; "
                                "a prefill message carries the state of the first N−1 tokens")
        if cache.batch_size != 1:
            raise TransferError(f"DecodeWorker decodes one sequence, the message holds {cache.batch_size}")
        dev, stops, out = _device(self.model), set(stop_token_ids), []
        cache, token = cache.to(dev), last
        while len(out) < max_tokens:
            logits = self.model(torch.tensor([[token]], device=dev), cache=cache, logits_to_keep=1).logits
            token = int(logits[0, -1].argmax())
            out.append(token)
            if token in stops:
                break
        return out
