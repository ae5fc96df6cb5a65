import pytest
from checkpoint_models import random_model

from k3.model.decoder import K3ForCausalLM


@pytest.fixture
def nano_model() -> K3ForCausalLM:
    return random_model("nano")
