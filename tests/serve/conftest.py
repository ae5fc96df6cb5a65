"""Fixtures: a random nano model + tokenizer saved once, and ``k3 serve`` running on it as a real
subprocess on a free loopback port (``k3.serve.launch``: ``--port 0``, ready once /health is ok)."""

from __future__ import annotations

import pytest

from k3.serve.launch import ServerProcess, launch

THINK_CAP_LOW = 3  # the servers run with --thinking-cap-low 3 so a test can reach the cap quickly


@pytest.fixture(scope="session")
def ckpt(tmp_path_factory, make_nano_checkpoint):
    return make_nano_checkpoint(tmp_path_factory.mktemp("serve") / "nano",
                                "hello world, the quick brown fox jumps over the lazy dog. ")


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
