"""Suite-wide fixtures: every test starts from the same seeds, so a run is reproducible."""

import random

import os

import numpy as np
import pytest
import torch
from hypothesis import settings

# Property tests draw the same examples on every run (a CI failure reproduces locally);
# K3_HYPOTHESIS=explore draws fresh ones, to hunt for new counterexamples.
settings.register_profile("repeatable", derandomize=True, database=None)
settings.register_profile("explore")
settings.load_profile("explore" if os.environ.get("K3_HYPOTHESIS") == "explore" else "repeatable")


# The test run is an entry point like the CLI: flush fp32 denormals (CPU KDA speed; k3 itself
# never sets this at import, tests/ops/test_denormal.py).
torch.set_flush_denormal(True)


@pytest.fixture(autouse=True)
def _seed_everything():
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    yield


@pytest.fixture(scope="session")
def make_nano_checkpoint():
    """A factory: ``make(dir, text) -> (dir, model, tokenizer)`` saves a seeded ``nano`` model whose
    lm_head is sharpened ×20 (greedy choices then are not float ties) and a 400-token BPE tokenizer
    trained on ``text`` × 30 — the served / generated model of the server, CLI and agent tests."""
    def make(d, text: str):
        from k3.checkpoint import save_pretrained
        from k3.config import get_preset
        from k3.data.tokenizer import train_tokenizer
        from k3.model.decoder import K3ForCausalLM

        torch.manual_seed(0)
        model = K3ForCausalLM(get_preset("nano"))
        with torch.no_grad():
            model.lm_head.weight.mul_(20)
        save_pretrained(model, d)
        tok = train_tokenizer([text * 30], vocab_size=400)
        tok.save(d)
        return d, model.eval(), tok
    return make


@pytest.fixture(scope="session")
def make_nano_vl_checkpoint():
    """A factory: ``make(dir, text) -> (dir, model, tokenizer)`` saves a seeded ``nano`` model with the
    ``nano`` vision tower (release layout, kimi_k3 wrapper), its <|media_pad|> the tokenizer's, and
    the lm_head sharpened ×20 like ``make_nano_checkpoint``'s."""
    def make(d, text: str):
        from k3.checkpoint import save_pretrained
        from k3.config import get_preset
        from k3.config.presets import vision_preset
        from k3.config.vision import with_vision
        from k3.data.tokenizer import train_tokenizer
        from k3.model.multimodal import K3VLForConditionalGeneration

        tok = train_tokenizer([text * 30], vocab_size=400)
        torch.manual_seed(0)
        cfg = with_vision(get_preset("nano"), vision_preset("nano"), tok.media_token_ids["<|media_pad|>"])
        model = K3VLForConditionalGeneration(cfg)
        with torch.no_grad():
            model.language_model.lm_head.weight.mul_(20)
        save_pretrained(model, d)
        tok.save(d)
        return d, model.eval(), tok
    return make
