"""Models for the checkpoint tests (a uniquely named module: ``conftest`` is ambiguous once
several test folders have one)."""

import torch

from k3.config import get_preset
from k3.model.decoder import K3ForCausalLM


def random_model(preset: str = "nano", seed: int = 0, **overrides) -> K3ForCausalLM:
    """A model whose every tensor (AttnRes queries and router biases included) holds distinct
    random values, so a round trip that drops or swaps anything is caught."""
    torch.manual_seed(seed)
    model = K3ForCausalLM(get_preset(preset, **overrides))
    with torch.no_grad():
        for t in model.state_dict().values():
            t.copy_(torch.randn_like(t) * 0.05)
    return model
