"""Fixtures: a random nano model + tokenizer saved once, and ``k3 serve`` running on it as a real
subprocess on a free loopback port (``k3.serve.launch``: ``--port 0``, ready once /health is ok)."""

from __future__ import annotations

import pytest
import torch

from k3.config import get_preset
from k3.model.decoder import K3ForCausalLM
from k3.serve.launch import ServerProcess, launch

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


def _server(ckpt_dir, *flags) -> ServerProcess:
    """``k3 serve`` on the nano checkpoint, 1 thread, low-effort thinking cap ``THINK_CAP_LOW``."""
    s = launch(ckpt_dir, "--thinking-cap-low", str(THINK_CAP_LOW), *flags, threads=1)
    s.cap_low = THINK_CAP_LOW
    return s


@pytest.fixture(scope="session")
def server(ckpt):
    with _server(ckpt[0]) as s:
        yield s


@pytest.fixture(scope="session")
def keyed_server(ckpt):
    with _server(ckpt[0], "--api-key", "sekrit", "--allow-missing-reasoning") as s:
        yield s
