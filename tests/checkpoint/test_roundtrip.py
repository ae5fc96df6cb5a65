import json
import os

import pytest
import torch
from checkpoint_models import random_model

from k3.checkpoint import (
    CheckpointError,
    convert,
    expected_tensors,
    from_pretrained,
    inspect,
    keeps_fp32,
    load_checkpoint,
    load_state_dict,
    save_pretrained,
)
from k3.config import get_preset
from k3.model.decoder import K3ForCausalLM


@pytest.mark.parametrize("preset", ["nano", "tiny", "small", "kimi-linear-48b", "k3"])
def test_expected_tensors_match_the_model_state_dict(preset):
    cfg = get_preset(preset)
    with torch.device("meta"):
        model = K3ForCausalLM(cfg)
    got = {n: (tuple(t.shape), t.dtype) for n, t in model.state_dict().items()}
    assert got == expected_tensors(cfg)


@pytest.mark.parametrize("preset,dtype", [("nano", torch.float32), ("nano", torch.bfloat16),
                                          ("tiny", torch.float32), ("tiny", torch.bfloat16)])
def test_save_load_round_trip_is_bit_exact(tmp_path, preset, dtype):
    model = random_model(preset)
    save_pretrained(model, tmp_path, max_shard_size="300KB", dtype=dtype)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1  # really sharded
    assert "model.layers.1.block_sparse_moe.experts.3.w2.weight" in index["weight_map"]
    loaded = from_pretrained(tmp_path)
    ref = model.state_dict()
    for name, t in loaded.state_dict().items():
        want = torch.float32 if keeps_fp32(name) else dtype
        assert t.dtype == want, name
        assert torch.equal(t, ref[name].to(want)), name
    if dtype == torch.float32:
        ids = torch.randint(0, model.config.vocab_size, (2, 7))
        with torch.no_grad():
            assert torch.equal(model(ids).logits, loaded(ids).logits)


def test_load_into_existing_model_overwrites_every_tensor(tmp_path):
    model = random_model("nano")
    save_pretrained(model, tmp_path, dtype=torch.bfloat16)
    target = random_model("nano", seed=1).to(torch.bfloat16)
    assert load_checkpoint(target, tmp_path) == []
    for (n, a), b in zip(model.state_dict().items(), target.state_dict().values()):
        assert torch.equal(a.to(b.dtype), b), n


def test_saved_dtypes_follow_the_release(tmp_path, nano_model):
    save_pretrained(nano_model, tmp_path, dtype=torch.bfloat16)
    from safetensors import safe_open
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    for name, shard in index["weight_map"].items():
        with safe_open(str(tmp_path / shard), "pt") as f:
            dt = f.get_slice(name).get_dtype()
        fp32 = name.endswith(("_conv1d.weight", ".A_log", ".dt_bias", ".o_norm.weight", ".e_score_correction_bias"))
        assert dt == ("F32" if fp32 else "BF16"), name


def test_meta_device_load_reads_no_tensor_data(tmp_path, nano_model):
    save_pretrained(nano_model, tmp_path)
    # Overwrite every shard's data section (headers intact): a data read would see garbage or fail.
    for f in tmp_path.glob("model-*.safetensors"):
        raw = bytearray(f.read_bytes())
        n = int.from_bytes(raw[:8], "little")
        raw[8 + n:] = b"\xff" * (len(raw) - 8 - n)
        f.write_bytes(bytes(raw))
    model = from_pretrained(tmp_path, device="meta")
    assert all(t.is_meta for t in model.state_dict().values())
    assert model.config.fingerprint() == nano_model.config.fingerprint()
    with pytest.raises(CheckpointError, match="sha256 mismatch"):  # a real load verifies the data
        from_pretrained(tmp_path)
    loaded = from_pretrained(tmp_path, verify=False)  # and without verification reads it
    assert torch.isnan(loaded.model.norm.weight).all()


def test_resave_into_same_directory_replaces_and_cleans_old_shards(tmp_path):
    a, b = random_model("nano", seed=1), random_model("nano", seed=2)
    save_pretrained(a, tmp_path, max_shard_size="200KB")
    first = set(os.listdir(tmp_path))
    save_pretrained(b, tmp_path, max_shard_size="200KB")
    second = set(os.listdir(tmp_path))
    assert not (first & second) - {"config.json", "model.safetensors.index.json"}  # fresh shard names
    loaded = from_pretrained(tmp_path)
    assert torch.equal(loaded.lm_head.weight, b.lm_head.weight)


def test_convert_reexports_and_inspect_summarises_from_headers(tmp_path, nano_model):
    save_pretrained(nano_model, tmp_path / "a", dtype=torch.float32)
    convert(tmp_path / "a", tmp_path / "b", dtype=torch.bfloat16)
    cfg, sd = load_state_dict(tmp_path / "b")
    assert sd["lm_head.weight"].dtype == torch.bfloat16 and sd["model.layers.0.self_attn.A_log"].dtype == torch.float32
    assert torch.equal(sd["model.layers.1.block_sparse_moe.experts.w1"],
                       nano_model.model.layers[1].block_sparse_moe.experts.w1.detach().to(torch.bfloat16))
    text = inspect(tmp_path / "b")
    n_params = sum(t.numel() for t in nano_model.state_dict().values())
    assert f"parameters {n_params:,}" in text
    assert "model.layers.{l}.block_sparse_moe.experts.{e}.w1.weight" in text
    assert "3 KDA" in text and "1 MLA" in text
