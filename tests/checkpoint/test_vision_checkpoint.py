"""Multimodal checkpoints in the release layout (SPEC §3.9, §4): K3VLForConditionalGeneration saves
text tensors under ``language_model.``, the vision tower and projector under their own names as
floats (never MXFP4) and config.json as the kimi_k3 wrapper; it loads back tensor for tensor; the
text-only load of the same directory is unchanged; a missing, unexpected or mis-shaped vision tensor
is refused by name (each refusal beside a positive control)."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from k3.checkpoint import CheckpointError, from_pretrained, load_checkpoint, save_pretrained
from k3.checkpoint.io import read_header
from k3.config import get_preset
from k3.model.decoder import K3ForCausalLM
from k3.model.multimodal import K3VLForConditionalGeneration
from k3.model.mx_experts import PackedMXFP4Experts, pack_routed_experts
from k3.config.presets import vision_preset

PAD = 7
VL = K3VLForConditionalGeneration

# the release's vision tensor names for a 2-block tower (research note §5), written out here
VISION_NAMES = {
    "vision_tower.patch_embed.proj.weight", "vision_tower.patch_embed.pos_emb.weight",
    *(f"vision_tower.encoder.blocks.{n}.{k}.weight" for n in range(2)
      for k in ("norm0", "norm1", "wqkv", "wo", "mlp.fc0", "mlp.fc1")),
    "vision_tower.encoder.final_layernorm.weight",
    "mm_projector.proj.0.weight", "mm_projector.proj.2.weight", "mm_projector.post_norm.weight",
}


def random_vl(seed: int = 0) -> VL:
    torch.manual_seed(seed)
    cfg = dataclasses.replace(get_preset("nano"), vision_config=vision_preset("nano").to_dict())
    model = VL(cfg, media_pad_token_id=PAD)
    with torch.no_grad():
        for t in model.state_dict().values():
            t.copy_(torch.randn_like(t) * 0.05)
    return model.eval()


def _weight_map(directory) -> dict[str, str]:
    with open(os.path.join(directory, "model.safetensors.index.json")) as f:
        return json.load(f)["weight_map"]


def _rewrite(src, dst, drop=(), add=None, replace=None):
    """A copy of checkpoint ``src`` as one model.safetensors (no index, no hashes) with tensors
    dropped, added or replaced."""
    os.makedirs(dst)
    shutil.copy(os.path.join(src, "config.json"), dst)
    tensors = {}
    for shard in sorted(set(_weight_map(src).values())):
        tensors.update(load_file(os.path.join(src, shard)))
    for n in drop:
        del tensors[n]
    tensors.update(add or {})
    tensors.update(replace or {})
    save_file(tensors, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    return dst


def test_release_layout_round_trip(tmp_path):
    model = random_vl()
    save_pretrained(model, tmp_path, max_shard_size="200KB")  # several shards
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["model_type"] == "kimi_k3" and cfg["architectures"] == ["KimiK3ForConditionalGeneration"]
    assert cfg["text_config"] == model.config.to_text_dict()
    assert cfg["vision_config"] == vision_preset("nano").to_dict()
    assert cfg["media_placeholder_token_id"] == PAD
    assert "quantization_config" not in cfg and "quantization_config" not in cfg["text_config"]
    names = set(_weight_map(tmp_path))
    assert len(set(_weight_map(tmp_path).values())) > 1
    assert {n for n in names if not n.startswith("language_model.")} == VISION_NAMES
    for n in ("language_model.model.embed_tokens.weight", "language_model.lm_head.weight",
              "language_model.model.layers.0.self_attn.A_log",
              "language_model.model.layers.1.block_sparse_moe.experts.0.w1.weight"):
        assert n in names, n
    back = from_pretrained(tmp_path, model_class=VL)
    assert isinstance(back, VL) and back.media_pad_token_id == PAD
    want, got = model.state_dict(), back.state_dict()
    assert set(want) == set(got)
    for n in want:
        assert got[n].dtype == want[n].dtype and torch.equal(got[n], want[n]), n
    meta = from_pretrained(tmp_path, model_class=VL, device="meta")  # headers only
    assert {n: tuple(t.shape) for n, t in meta.state_dict().items()} == {n: tuple(t.shape) for n, t in want.items()}
    # in place into a fresh model as well
    fresh = VL(model.config, media_pad_token_id=PAD)
    assert load_checkpoint(fresh, tmp_path) == []
    assert all(torch.equal(fresh.state_dict()[n], want[n]) for n in want)
    # the default text load reads the text part of the same directory, vision ignored (as before)
    text = from_pretrained(tmp_path)
    assert type(text) is K3ForCausalLM
    tw = model.language_model.state_dict()
    assert set(text.state_dict()) == set(tw)
    assert all(torch.equal(text.state_dict()[n], tw[n]) for n in tw)
    ids = torch.randint(PAD + 1, 512, (1, 10))
    with torch.no_grad():
        assert torch.equal(text(ids).logits, model(ids).logits)


def test_dtype_request_applies_to_vision_tensors(tmp_path):
    model = random_vl()
    save_pretrained(model, tmp_path, dtype=torch.bfloat16)
    headers = {}
    for shard in set(_weight_map(tmp_path).values()):
        headers.update(read_header(os.path.join(tmp_path, shard)))
    assert all(headers[n].dtype == torch.bfloat16 for n in VISION_NAMES)
    assert headers["language_model.model.layers.0.self_attn.A_log"].dtype == torch.float32  # fp32-kept
    back = from_pretrained(tmp_path, model_class=VL)
    for n, t in model.vision_state_dict().items():
        assert torch.equal(back.state_dict()[n], t.to(torch.bfloat16)), n


def test_packed_experts_never_pack_the_vision_tensors(tmp_path):
    model = random_vl()
    pack_routed_experts(model.language_model)
    save_pretrained(model, tmp_path, dtype=torch.bfloat16)
    cfg = json.loads((tmp_path / "config.json").read_text())
    ignore = cfg["quantization_config"]["ignore"]  # on top of the wrapper, as the release has it
    assert "re:.*vision_tower.*" in ignore and "re:.*mm_projector.*" in ignore
    headers = {}
    for shard in set(_weight_map(tmp_path).values()):
        headers.update(read_header(os.path.join(tmp_path, shard)))
    assert any(n.endswith(".weight_packed") for n in headers)
    assert all(headers[n].dtype == torch.bfloat16 for n in VISION_NAMES)
    back = from_pretrained(tmp_path, model_class=VL)
    assert any(isinstance(m, PackedMXFP4Experts) for m in back.modules())
    ids = torch.randint(PAD + 1, 512, (1, 8))
    with torch.no_grad():
        assert torch.equal(back(ids).logits, model.to(torch.bfloat16)(ids).logits)


def test_missing_unexpected_or_misshaped_vision_tensor_is_refused_by_name(tmp_path):
    model = random_vl()
    src = tmp_path / "src"
    save_pretrained(model, src)
    ok = _rewrite(src, tmp_path / "ok")  # positive control: the same rewrite, nothing changed
    assert all(torch.equal(from_pretrained(ok, model_class=VL).state_dict()[n], t)
               for n, t in model.state_dict().items())
    gone = "vision_tower.encoder.blocks.1.mlp.fc1.weight"
    missing = _rewrite(src, tmp_path / "missing", drop=[gone])
    with pytest.raises(CheckpointError, match=rf"missing vision tensor {gone}"):
        from_pretrained(missing, model_class=VL)
    with pytest.raises(CheckpointError, match=rf"missing vision tensor {gone}"):
        load_checkpoint(VL(model.config, media_pad_token_id=PAD), missing)
    assert type(from_pretrained(missing)) is K3ForCausalLM  # the text load never needed it
    stray = "vision_tower.encoder.blocks.2.wqkv.weight"
    extra = _rewrite(src, tmp_path / "extra", add={stray: torch.zeros(192, 64)})
    with pytest.raises(CheckpointError, match=rf"unexpected vision tensor '{stray}'"):
        from_pretrained(extra, model_class=VL)
    assert load_checkpoint(VL(model.config, media_pad_token_id=PAD), extra, strict=False) == [stray]
    bad = "mm_projector.proj.2.weight"
    shaped = _rewrite(src, tmp_path / "shaped", replace={bad: torch.zeros(64, 128)})
    with pytest.raises(CheckpointError, match=rf"'{bad}': shape \[64, 128\], expected \[64, 256\]"):
        from_pretrained(shaped, model_class=VL)


def test_text_only_checkpoint_has_no_vision_to_load(tmp_path):
    model = random_vl()
    save_pretrained(model.language_model, tmp_path)  # the text model alone: flat config, no vision
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert "text_config" not in cfg and "vision_config" not in cfg
    assert not any(n.startswith("language_model.") for n in _weight_map(tmp_path))
    with pytest.raises(CheckpointError, match="no vision_config"):
        from_pretrained(tmp_path, model_class=VL)
    assert type(from_pretrained(tmp_path)) is K3ForCausalLM  # control


def test_expected_vision_tensors_match_the_model_and_the_release_count():
    from k3.checkpoint.names import expected_vision_tensors
    from k3.model.vision import VisionModel
    from k3.config.vision import RELEASE_VISION_CONFIG, VisionConfig

    release = expected_vision_tensors(VisionConfig.from_dict(RELEASE_VISION_CONFIG))
    assert sum(torch.Size(s).numel() for s in release.values()) == 447_358_976  # SPEC §3.9
    assert release["vision_tower.encoder.blocks.26.wqkv.weight"] == (4608, 1024)
    assert release["mm_projector.proj.2.weight"] == (7168, 4096)
    for vc in (vision_preset("nano"), dataclasses.replace(vision_preset("nano"), attn_bias=True,
                                                          linear_bias=True, patch_embed_proj_bias=True)):
        shapes = {n: tuple(t.shape) for n, t in VisionModel(vc).state_dict().items()}
        assert shapes == expected_vision_tensors(vc)
