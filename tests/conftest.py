"""Suite-wide fixtures: every test starts from the same seeds, so a run is reproducible."""

import random

import numpy as np
import pytest
import torch


# The test run is an entry point like the CLI: flush fp32 denormals (CPU KDA speed; k3 itself
# never sets this at import, tests/ops/test_denormal.py).
torch.set_flush_denormal(True)


@pytest.fixture(autouse=True)
def _seed_everything():
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    yield
