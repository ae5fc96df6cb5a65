"""Fixtures: a random nano model + tokenizer saved once, and ``k3 serve`` running on it as a real
subprocess on a free loopback port (``--port 0``; the bound port is read from its first line)."""

from __future__ import annotations

import os
import queue
import subprocess
import sys
import threading

import httpx
import pytest
import torch

from k3.config import get_preset
from k3.model.decoder import K3ForCausalLM

THINK_CAP_LOW = 3  # the servers run with --thinking-cap-low 3 so a test can reach the cap quickly


@pytest.fixture(scope="session")
def ckpt(tmp_path_factory):
    from k3.checkpoint import save_pretrained
    from k3.data.tokenizer import train_tokenizer

    d = tmp_path_factory.mktemp("serve") / "nano"
    torch.manual_seed(0)
    model = K3ForCausalLM(get_preset("nano"))
    with torch.no_grad():
        model.lm_head.weight.mul_(20)
    save_pretrained(model, d)
    tok = train_tokenizer(["hello world, the quick brown fox jumps over the lazy dog. " * 30], vocab_size=400)
    tok.save(d)
    return d, model.eval(), tok


class Server:
    def __init__(self, ckpt_dir, *flags):
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "k3.cli", "serve", str(ckpt_dir), "--port", "0",
             "--thinking-cap-low", str(THINK_CAP_LOW), *flags],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        lines: queue.Queue = queue.Queue()
        threading.Thread(target=lambda: [lines.put(x) for x in self.proc.stdout], daemon=True).start()
        try:
            first = lines.get(timeout=120)
        except queue.Empty:
            first = ""
        if "listening on http://" not in first:
            self.stop()
            raise RuntimeError(f"k3 serve did not start: {first!r} {self.proc.stderr.read()[-2000:]}")
        self.url = first.split("listening on ")[1].split()[0]
        self.cap_low = THINK_CAP_LOW

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def healthy(self) -> bool:
        r = httpx.get(self.url + "/health", timeout=10)
        return r.status_code == 200 and r.json() == {"status": "ok"}

    def metric(self, name: str) -> float:
        text = httpx.get(self.url + "/metrics", timeout=10).text
        for line in text.splitlines():
            if line.split(" ")[0] == name:
                return float(line.split(" ")[1])
        raise KeyError(name)


@pytest.fixture(scope="session")
def server(ckpt):
    s = Server(ckpt[0])
    try:
        yield s
    finally:
        s.stop()


@pytest.fixture(scope="session")
def keyed_server(ckpt):
    s = Server(ckpt[0], "--api-key", "sekrit", "--allow-missing-reasoning")
    try:
        yield s
    finally:
        s.stop()
