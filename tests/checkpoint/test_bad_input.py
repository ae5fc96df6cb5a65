"""Every bad checkpoint fails with one error naming the file and tensor, before any copy."""
import json
import logging

import pytest
import torch
from checkpoint_models import random_model
from safetensors.torch import load_file, save_file

from k3.checkpoint import CheckpointError, from_pretrained, load_checkpoint, save_pretrained

INDEX = "model.safetensors.index.json"


@pytest.fixture
def ckpt(tmp_path):
    save_pretrained(random_model("nano"), tmp_path, max_shard_size="200KB")
    return tmp_path


def _index(d):
    return json.loads((d / INDEX).read_text())


def _edit(d, name, fn):
    """Apply fn(tensors dict) to the shard holding `name` (or the last shard), keep the index in step."""
    idx = _index(d)
    shard = idx["weight_map"].get(name) or sorted(set(idx["weight_map"].values()))[-1]
    tensors = load_file(str(d / shard))
    fn(tensors)
    save_file(tensors, str(d / shard), metadata={"format": "pt"})
    wm = {k: v for k, v in idx["weight_map"].items() if v != shard}
    wm.update({k: shard for k in tensors})
    idx["weight_map"] = wm
    idx.get("metadata", {}).pop("sha256", None)  # a hand-edited checkpoint: no longer k3's bytes
    (d / INDEX).write_text(json.dumps(idx))
    return d / shard


def _assert_untouched(d, match):
    model = random_model("nano", seed=5)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CheckpointError, match=match):
        load_checkpoint(model, d)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), f"{k} was modified by a failed load"


def test_missing_tensor_is_named(ckpt):
    _edit(ckpt, "model.layers.0.self_attn.A_log", lambda t: t.pop("model.layers.0.self_attn.A_log"))
    _assert_untouched(ckpt, r"missing tensor model\.layers\.0\.self_attn\.A_log")


def test_missing_expert_is_named(ckpt):
    n = "model.layers.2.block_sparse_moe.experts.3.w2.weight"
    _edit(ckpt, n, lambda t: t.pop(n))
    _assert_untouched(ckpt, r"missing tensor model\.layers\.2\.block_sparse_moe\.experts\.3\.w2\.weight")


def test_unexpected_tensor_fails_strict_and_is_listed_lenient(ckpt, caplog):
    extra = "model.layers.0.self_attn.bogus.weight"
    shard = _edit(ckpt, "model.norm.weight", lambda t: t.__setitem__(extra, torch.zeros(3)))
    _assert_untouched(ckpt, rf"{shard}: unexpected tensor '{extra}'")
    model = random_model("nano", seed=5)
    with caplog.at_level(logging.WARNING, logger="k3.checkpoint"):
        assert load_checkpoint(model, ckpt, strict=False) == [extra]
    assert extra in caplog.text


def test_wrong_shape_in_last_shard_leaves_model_untouched(ckpt):
    last = sorted(set(_index(ckpt)["weight_map"].values()))[-1]
    name = sorted(k for k, v in _index(ckpt)["weight_map"].items() if v == last)[0]
    shard = _edit(ckpt, name, lambda t: t.__setitem__(name, torch.zeros(*t[name].shape[:-1], t[name].shape[-1] + 1)))
    _assert_untouched(ckpt, rf"{shard}: tensor '{name}': shape \[")


def test_packed_expert_weights_must_be_uint8(ckpt):
    base = "model.layers.1.block_sparse_moe.experts.0.w1"

    def to_packed(t):
        w = t.pop(base + ".weight")  # [F, ℓ] = [32, 32]
        t[base + ".weight_packed"] = torch.zeros(w.shape[0], w.shape[1] // 2)  # float: wrong
        t[base + ".weight_scale"] = torch.full((w.shape[0], w.shape[1] // 32), 127, dtype=torch.uint8)

    shard = _edit(ckpt, base + ".weight", to_packed)
    _assert_untouched(ckpt, rf"{shard}: tensor '{base}.weight_packed': MXFP4 codes must be uint8")


def test_packed_expert_without_its_scale_is_missing(ckpt):
    base = "model.layers.1.block_sparse_moe.experts.0.w1"

    def to_packed(t):
        w = t.pop(base + ".weight")
        t[base + ".weight_packed"] = torch.zeros(w.shape[0], w.shape[1] // 2, dtype=torch.uint8)

    _edit(ckpt, base + ".weight", to_packed)
    _assert_untouched(ckpt, r"experts\.0\.w1\.weight \(found only \['packed'\]\)")


def test_truncated_shard_is_named(ckpt):
    shard = ckpt / sorted(set(_index(ckpt)["weight_map"].values()))[1]
    shard.write_bytes(shard.read_bytes()[:-100])
    _assert_untouched(ckpt, rf"{shard}: truncated")


def test_corrupt_header_is_named(ckpt):
    shard = ckpt / sorted(set(_index(ckpt)["weight_map"].values()))[0]
    raw = bytearray(shard.read_bytes())
    raw[8:40] = b"\x00not json at all\x00".ljust(32, b"#")
    shard.write_bytes(bytes(raw))
    _assert_untouched(ckpt, rf"{shard}: corrupt safetensors header")


def test_index_pointing_to_missing_shard(ckpt):
    shard = sorted(set(_index(ckpt)["weight_map"].values()))[-1]
    (ckpt / shard).unlink()
    _assert_untouched(ckpt, rf"{INDEX}: tensor '.*' points to missing shard .*{shard}")


def test_config_that_does_not_parse(ckpt):
    (ckpt / "config.json").write_text('{"hidden_size": 64,,}')
    with pytest.raises(CheckpointError, match=r"config\.json: not valid JSON"):
        from_pretrained(ckpt)


def test_config_that_fails_validation_names_the_field(ckpt):
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["kv_lora_rank"] = 0
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"config\.json: invalid config: kv_lora_rank must be > 0"):
        from_pretrained(ckpt)


def test_checkpoint_of_another_size_is_rejected_by_shape(ckpt):
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["hidden_size"] = 96
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"model\.embed_tokens\.weight': shape \[512, 64\], expected \[512, 96\]"):
        from_pretrained(ckpt)
