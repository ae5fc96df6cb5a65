"""State messages, transports and the prefill/decode workers, against a full-forward greedy reference."""

import copy
import json
import os
import struct
import subprocess
import sys
import threading

import pytest
import torch

from k3.config import get_preset
from k3.infer.transfer import (DecodeWorker, InProcessTransport, PrefillWorker, SocketTransport,
                               TransferError, decode_message, decode_state, encode_state)
from k3.model.cache import KDAState
from k3.model.decoder import K3ForCausalLM

CFG = get_preset("nano")
LAC = CFG.linear_attn_config


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return K3ForCausalLM(CFG).eval()


def prompt_of(n, seed):
    return torch.randint(1, CFG.vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@torch.no_grad()
def greedy_full(model, prompt, n):
    """Reference: recompute the full no-cache forward each step and take the argmax."""
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def tensor_bytes(n_tokens, kv_size=4, conv_size=4):
    """Bytes of the state after ``n_tokens``, from the config: KDA conv + fp32 recurrent per KDA
    layer, (kv_lora_rank + rope) per token per MLA layer; nothing at all before the first token."""
    if n_tokens == 0:
        return 0
    P, K = LAC.num_heads * LAC.head_dim, LAC.short_conv_kernel_size
    kda = len(LAC.kda_layers) * (3 * P * (K - 1) * conv_size + LAC.num_heads * LAC.head_dim ** 2 * 4)
    mla = len(LAC.full_attn_layers) * n_tokens * (CFG.kv_lora_rank + CFG.qk_rope_head_dim) * kv_size
    return kda + mla


def header_len(message):
    return 10 + struct.unpack(">I", message[6:10])[0]  # magic 4, version 2, length 4, then JSON


def test_round_trip_restores_every_tensor_and_dtype(model):
    for m in (model, copy.deepcopy(model).to(torch.bfloat16)):
        cache = m.new_cache(1)
        with torch.no_grad():
            m(torch.tensor([prompt_of(21, 1)]), cache=cache)
        msg = encode_state(cache, CFG, meta={"x": 1})
        back, meta = decode_message(msg, CFG)
        assert meta == {"x": 1} and back.seq_len == 21
        for a, b in zip(cache.layers, back.layers):
            pairs = [(a.conv, b.conv), (a.recurrent, b.recurrent)] if isinstance(a, KDAState) else \
                [(a.c, b.c), (a.k_pe, b.k_pe)]
            for x, y in pairs:
                assert x.dtype == y.dtype and torch.equal(x, y)
        kv = 2 if m is not model else 4
        assert len(msg) == header_len(msg) + tensor_bytes(21, kv_size=kv, conv_size=kv)


def test_bad_messages_are_refused_by_name(model):
    cache = model.new_cache(1)
    with torch.no_grad():
        model(torch.tensor([prompt_of(9, 2)]), cache=cache)
    msg = encode_state(cache, CFG)
    assert decode_state(msg, CFG).seq_len == 9  # positive control
    other = get_preset("nano", vocab_size=1024)
    cases = {
        "magic": b"XXXX" + msg[4:],
        "version 7": msg[:4] + struct.pack(">H", 7) + msg[6:],
        "different model config": None,
        "truncated": msg[:-1],
        "after its last tensor": msg + b"\0",
        "header": msg[:20],
    }
    for what, bad in cases.items():
        with pytest.raises(TransferError, match=what):
            decode_state(bad, CFG) if bad is not None else decode_state(msg, other)
    forged = msg.replace(b'"seq_len": 9', b'"seq_len": 8')
    with pytest.raises(TransferError, match="does not fit the config"):
        decode_state(forged, CFG)


def test_socket_transport_frames_messages_and_reports_a_cut_connection():
    sizes = [0, 1, 3 << 20]
    with SocketTransport.listen() as listener:
        got = []

        def peer():
            with listener.accept(timeout=30) as conn:
                got.extend(conn.recv(timeout=30) for _ in sizes)

        th = threading.Thread(target=peer)
        th.start()
        with SocketTransport.connect(listener.port) as t:
            for n in sizes:
                t.send(bytes(range(256)) * (n // 256) + b"x" * (n % 256))
        th.join(timeout=60)
        assert not th.is_alive()
        assert [len(m) for m in got] == sizes and got[2][:3] == bytes([0, 1, 2]) and t.bytes_sent == sum(sizes)

        with SocketTransport.connect(listener.port) as t, listener.accept(timeout=30) as conn:
            t._sock.sendall(struct.pack(">Q", 100) + b"only ten b")  # a frame cut short
            t.close()
            with pytest.raises(TransferError, match="closed after 10 of 100 bytes"):
                conn.recv(timeout=30)
        with SocketTransport.connect(listener.port) as t, listener.accept(timeout=30) as conn:
            with pytest.raises(TransferError, match="within 0.2 s"):
                conn.recv(timeout=0.2)


def test_in_process_workers_equal_full_forward_greedy(model):
    prompt = prompt_of(19, 3)
    want = greedy_full(model, prompt, 10)
    t = InProcessTransport()
    msg = PrefillWorker(model, t, prefill_chunk=7).prefill(prompt)
    assert DecodeWorker(model, t).decode(max_tokens=10) == want
    assert t.bytes_sent == t.bytes_received == len(msg) == header_len(msg) + tensor_bytes(18)
    assert DecodeWorker(model).decode(PrefillWorker(model).prefill(prompt[:1]), max_tokens=4) == \
        greedy_full(model, prompt[:1], 4)  # N = 1: an empty state, the one token fed on decode


def test_last_prompt_token_is_fed_exactly_once(model):
    prompt = prompt_of(15, 4)
    want = greedy_full(model, prompt, 6)
    msg = PrefillWorker(model).prefill(prompt)
    assert decode_state(msg, CFG).seq_len == 14
    assert DecodeWorker(model).decode(msg, max_tokens=6) == want
    # The classic bug: the prefill runs all N tokens and the decode side feeds the last one again.
    # It changes the output here, so the equality above could not hold with it.
    with torch.no_grad():
        cache = model.new_cache(1)
        model(torch.tensor([prompt]), cache=cache)
        doubled = [prompt[-1]]
        for _ in range(6):
            logits = model(torch.tensor([[doubled[-1]]]), cache=cache, logits_to_keep=1).logits
            doubled.append(int(logits[0, -1].argmax()))
        assert doubled[1:] != want
        # A message claiming that state for this prompt is refused rather than decoded.
        bad = encode_state(cache, CFG, meta={"last_token": prompt[-1], "prompt_len": len(prompt)})
    with pytest.raises(TransferError, match="first N−1 tokens"):
        DecodeWorker(model).decode(bad, max_tokens=6)


_PREFILL_PROCESS = r"""
import json, sys, torch
from k3.config import get_preset
from k3.model.decoder import K3ForCausalLM
from k3.infer.transfer import PrefillWorker, SocketTransport
torch.set_flush_denormal(True)
port, path, prompt = int(sys.argv[1]), sys.argv[2], json.loads(sys.argv[3])
model = K3ForCausalLM(get_preset("nano")).eval()
model.load_state_dict(torch.load(path))
with SocketTransport.connect(port) as t:
    worker = PrefillWorker(model, t, prefill_chunk=8)
    worker.prefill(prompt)
print(json.dumps({"bytes_sent": worker.bytes_sent, "pid": __import__("os").getpid()}))
"""


def test_prefill_and_decode_in_two_processes_over_a_socket(model, tmp_path):
    prompt = prompt_of(27, 5)
    want = greedy_full(model, prompt, 12)
    weights = tmp_path / "nano.pt"
    torch.save(model.state_dict(), weights)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    with SocketTransport.listen() as listener:
        proc = subprocess.Popen([sys.executable, "-c", _PREFILL_PROCESS, str(listener.port), str(weights),
                                 json.dumps(prompt)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, env=env)
        try:
            with listener.accept(timeout=120) as conn:
                worker = DecodeWorker(model, conn)
                got = worker.decode(max_tokens=12)
            out, err = proc.communicate(timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    assert proc.returncode == 0, err
    report = json.loads(out.strip().splitlines()[-1])
    assert report["pid"] != os.getpid()
    assert got == want
    expected = tensor_bytes(len(prompt) - 1)
    assert worker.bytes_received == report["bytes_sent"]
    assert expected < worker.bytes_received <= expected + 4096  # the header is small JSON
    assert worker.bytes_received == expected + header_len(PrefillWorker(model).prefill(prompt))
