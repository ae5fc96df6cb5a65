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
