"""Every checkpoint directory verifies its bytes (sha256 per shard in the k3 index): a flipped bit,
a NaN block or a zeroed block in tensor data fails every load path naming the file; the untouched
checkpoint loads; verify=False / --no-verify loads the modified one; a foreign checkpoint without
hashes loads after a one-line notice, once."""
import hashlib
import json
import logging

import pytest
import torch
from checkpoint_models import random_model

from k3.checkpoint import (CheckpointError, convert, from_pretrained, inspect, load_checkpoint, load_state_dict,
                           save_pretrained)
from k3.checkpoint.quantize import quantize
from k3.cli import main

INDEX = "model.safetensors.index.json"


def _data_start(raw):
    return 8 + int.from_bytes(raw[:8], "little")


def _flip_bit(raw):
    raw[_data_start(raw) + 100] ^= 0x01


def _nan_block(raw):  # 64 fp32 NaNs in the middle of the tensor data
    mid = (_data_start(raw) + len(raw)) // 2 // 4 * 4
    raw[mid:mid + 256] = torch.full((64,), float("nan")).numpy().tobytes()


def _zero_block(raw):
    mid = (_data_start(raw) + len(raw)) // 2
    raw[mid:mid + 256] = bytes(256)


DAMAGE = {"flipped_bit": _flip_bit, "nan_block": _nan_block, "zeroed_block": _zero_block}


@pytest.fixture
def ckpt(tmp_path):
    save_pretrained(random_model("nano"), tmp_path / "m", max_shard_size="300KB")
    return tmp_path / "m"


def _shards(d):
    return sorted(set(json.loads((d / INDEX).read_text())["weight_map"].values()))


def _damage(d, how):
    shard = d / _shards(d)[1]
    raw = bytearray(shard.read_bytes())
    before = bytes(raw)
    DAMAGE[how](raw)
    assert bytes(raw) != before
    shard.write_bytes(bytes(raw))
    return shard


def test_index_carries_the_sha256_of_every_shard(ckpt):
    meta = json.loads((ckpt / INDEX).read_text())["metadata"]
    assert len(_shards(ckpt)) > 1 and set(meta["sha256"]) == set(_shards(ckpt))
    for shard in _shards(ckpt):  # hashlib over the file as written, independent of k3's hashing
        assert meta["sha256"][shard] == hashlib.sha256((ckpt / shard).read_bytes()).hexdigest()


@pytest.mark.parametrize("writer", ["convert", "quantize"])
def test_convert_and_quantize_outputs_carry_hashes_too(ckpt, writer):
    out = ckpt.parent / writer
    (convert if writer == "convert" else quantize)(ckpt, out)
    meta = json.loads((out / INDEX).read_text())["metadata"]
    assert meta["format"] == "k3" and set(meta["sha256"]) == set(_shards(out))
    for shard in _shards(out):
        assert meta["sha256"][shard] == hashlib.sha256((out / shard).read_bytes()).hexdigest()


LOADS = {
    "from_pretrained": lambda d, **k: from_pretrained(d, **k),
    "load_checkpoint": lambda d, **k: load_checkpoint(random_model("nano", seed=9), d, **k),
    "load_state_dict": lambda d, **k: load_state_dict(d, **k),
    "convert": lambda d, **k: convert(d, d.parent / "converted", **k),
    "quantize": lambda d, **k: quantize(d, d.parent / "quantized", **k),
    "inspect": lambda d, **k: inspect(d, **k),
}


@pytest.mark.parametrize("how", sorted(DAMAGE))
@pytest.mark.parametrize("path", sorted(LOADS))
def test_damaged_data_fails_every_load_path_naming_the_file(ckpt, path, how):
    LOADS[path](ckpt)  # positive control: the untouched checkpoint loads
    shard = _damage(ckpt, how)
    with pytest.raises(CheckpointError, match=f"{shard}: sha256 mismatch"):
        LOADS[path](ckpt)
    LOADS[path](ckpt, verify=False)  # skipping the check loads the modified bytes


def test_unverified_load_really_reads_the_damaged_bytes(ckpt):
    ref = from_pretrained(ckpt)
    _damage(ckpt, "nan_block")
    loaded = from_pretrained(ckpt, verify=False)
    assert any(torch.isnan(t).any() for t in loaded.state_dict().values())
    assert not any(torch.isnan(t).any() for t in ref.state_dict().values())


def _write_tokenizer(path):
    from k3.data.tokenizer import train_tokenizer
    train_tokenizer(["a small text to train on, twice: a small text to train on"], 300).save(path)


def test_sample_model_path_verifies(ckpt):
    from k3.infer.run_model import load_run_model
    _write_tokenizer(ckpt / "tokenizer.json")
    model, _ = load_run_model(ckpt)  # positive control: `k3 sample DIR/model` loads the untouched model
    assert model.config.hidden_size == 64
    shard = _damage(ckpt, "flipped_bit")
    with pytest.raises(CheckpointError, match=f"{shard}: sha256 mismatch"):
        load_run_model(ckpt)


@pytest.mark.parametrize("cmd", ["convert", "quantize", "inspect"])
def test_cli_no_verify_flag(ckpt, tmp_path, capsys, cmd):
    args = [cmd, str(ckpt)] + ([str(tmp_path / f"out-{cmd}")] if cmd != "inspect" else [])
    _damage(ckpt, "zeroed_block")
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "sha256 mismatch" in err[0] and str(ckpt) in err[0]
    assert main(args + ["--no-verify"]) == 0


def test_foreign_checkpoint_loads_with_one_notice(ckpt, caplog):
    idx = json.loads((ckpt / INDEX).read_text())
    idx["metadata"] = {"total_size": idx["metadata"]["total_size"]}  # as transformers writes it
    (ckpt / INDEX).write_text(json.dumps(idx))
    with caplog.at_level(logging.WARNING, logger="k3.checkpoint"):
        from_pretrained(ckpt)
        load_state_dict(ckpt)
    notes = [r.getMessage() for r in caplog.records if "sha256" in r.getMessage()]
    assert len(notes) == 1 and str(ckpt) in notes[0] and "\n" not in notes[0]


def test_a_shard_missing_from_the_hashes_is_refused(ckpt):
    from_pretrained(ckpt)  # positive control
    idx = json.loads((ckpt / INDEX).read_text())
    dropped = _shards(ckpt)[0]
    del idx["metadata"]["sha256"][dropped]
    (ckpt / INDEX).write_text(json.dumps(idx))
    with pytest.raises(CheckpointError, match=f"{ckpt / dropped}: no sha256"):
        from_pretrained(ckpt)
