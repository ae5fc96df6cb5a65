"""Shared fixtures of the inference tests."""

import threading

import pytest
import torch

from k3.config import get_preset
from k3.model.decoder import K3ForCausalLM


@pytest.fixture(scope="module")
def model():
    """A random nano model with sharper logits than the 0.02 init, so greedy choices are well
    separated (files that need another config define their own ``model``)."""
    torch.manual_seed(0)
    torch.set_num_threads(1)
    m = K3ForCausalLM(get_preset("nano"))
    with torch.no_grad():
        m.lm_head.weight.mul_(20)
    return m.eval()


@pytest.fixture
def no_engine_thread_left():
    """Every test closes the engines it starts: no scheduler thread outlives it (used by the files
    whose tests each start their own engines: ``pytestmark = usefixtures(...)``)."""
    yield
    assert not [t for t in threading.enumerate() if t.name == "k3-engine"]
