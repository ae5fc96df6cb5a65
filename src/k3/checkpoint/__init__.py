"""Checkpoints: HF-named safetensors shards + index + config.json (SPEC §4).

- ``names``:      the one mapping between on-disk names and k3's state dict; ``expected_tensors``
- ``io``:         safetensors headers (checked), streaming writer, atomic file replacement
- ``save``:       atomic sharded save of a state dict
- ``load``:       scan headers → validate everything → stream shard by shard
- ``pretrained``: ``save_pretrained(model, dir)`` / ``load_checkpoint(model, dir)`` /
                  ``from_pretrained(dir)`` -- the user entry points (``k3.model`` never imports this
                  package: these replace the former ``K3ForCausalLM`` methods)
- ``kimi_linear``: what a Kimi-Linear-mode save writes so transformers loads it
- ``tools``:      ``k3 convert`` and ``k3 inspect``; ``quantize``: ``k3 quantize``
- ``training``:   a training run's checkpoint folder (versioned commit, manifest, trainer state, RNG)
- ``rundir``:     run directories (lock, marker, claiming a folder for a fresh run)
- ``dcp``:        a distributed run's ``torch.distributed.checkpoint`` shards, and their conversion

Every k3-written checkpoint carries per-shard sha256 in its index and every load verifies it
(``verify=False`` / ``--no-verify`` to skip).
"""

from k3.checkpoint.io import CheckpointError
from k3.checkpoint.load import load_state_dict, read_config, scan
from k3.checkpoint.names import expected_tensors, keeps_fp32
from k3.checkpoint.pretrained import from_pretrained, load_checkpoint, save_pretrained
from k3.checkpoint.save import save_state_dict
from k3.checkpoint.tools import convert, inspect

__all__ = ["CheckpointError", "expected_tensors", "keeps_fp32", "save_state_dict", "load_state_dict",
           "read_config", "scan", "save_pretrained", "load_checkpoint", "from_pretrained", "convert",
           "inspect"]
