"""A save killed with SIGKILL leaves the previous checkpoint loadable and no half checkpoint."""
import os
import signal
import subprocess
import sys

import pytest
import torch
from checkpoint_models import random_model

from k3.checkpoint import CheckpointError, from_pretrained, save_pretrained
from k3.checkpoint.save import CRASH_ENV, TMP_PREFIX

_SAVE = """
import sys, torch
from k3.config import get_preset
from k3.checkpoint import save_pretrained
from k3.model.decoder import K3ForCausalLM
torch.manual_seed(123)
model = K3ForCausalLM(get_preset("nano"))
save_pretrained(model, sys.argv[1], max_shard_size="200KB")
"""


def _killed_save(directory, where):
    env = dict(os.environ, **{CRASH_ENV: where})
    proc = subprocess.run([sys.executable, "-c", _SAVE, str(directory)], env=env, capture_output=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]


def _same(model, directory):
    loaded = from_pretrained(directory)
    ref = model.state_dict()
    return all(torch.equal(t, ref[n]) for n, t in loaded.state_dict().items())


@pytest.mark.slow
@pytest.mark.parametrize("where", ["shard:2", "commit"])
def test_killed_save_keeps_previous_checkpoint(tmp_path, where):
    old = random_model("nano", seed=7)
    save_pretrained(old, tmp_path, max_shard_size="200KB")
    _killed_save(tmp_path, where)
    leftovers = [f for f in os.listdir(tmp_path) if f.startswith(TMP_PREFIX)]
    assert leftovers or where == "commit"
    assert _same(old, tmp_path)
    new = random_model("nano", seed=8)
    save_pretrained(new, tmp_path, max_shard_size="200KB")  # the next save cleans up and commits
    assert not [f for f in os.listdir(tmp_path) if f.startswith(TMP_PREFIX)]
    assert _same(new, tmp_path)


@pytest.mark.slow
def test_killed_first_save_leaves_nothing_loadable(tmp_path):
    _killed_save(tmp_path, "commit")  # every shard and config.json renamed, index not yet
    assert any(f.startswith("model-") for f in os.listdir(tmp_path))
    with pytest.raises(CheckpointError, match="interrupted save"):
        from_pretrained(tmp_path)
