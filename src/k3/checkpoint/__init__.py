"""Checkpoints: HF-named safetensors shards + index + config.json (SPEC §4).

- ``names``:      the one mapping between on-disk names and k3's state dict; ``expected_tensors``
- ``io``:         safetensors headers (checked), streaming writer, atomic file replacement
- ``save``:       atomic sharded save of a state dict
- ``load``:       scan headers → validate everything → stream shard by shard
- ``pretrained``: ``save_pretrained`` / ``load_checkpoint`` / ``from_pretrained`` for a model
- ``tools``:      ``k3 convert`` and ``k3 inspect``
"""

from k3.checkpoint.io import CheckpointError
from k3.checkpoint.load import load_state_dict, read_config, scan
from k3.checkpoint.names import expected_tensors, keeps_fp32
from k3.checkpoint.pretrained import from_pretrained, load_checkpoint, save_pretrained
from k3.checkpoint.save import save_state_dict
from k3.checkpoint.tools import convert, convert_main, inspect, inspect_main

__all__ = ["CheckpointError", "expected_tensors", "keeps_fp32", "save_state_dict", "load_state_dict",
           "read_config", "scan", "save_pretrained", "load_checkpoint", "from_pretrained", "convert",
           "inspect", "convert_main", "inspect_main"]
