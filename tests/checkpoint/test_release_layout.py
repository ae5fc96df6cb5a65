"""A checkpoint in the released K3 multimodal layout (SPEC §4): kimi_k3 wrapper config,
``language_model.`` prefixes, vision tensors, A_log padded to 128, routed experts as packed MXFP4."""
import json
import logging

import torch
from checkpoint_models import random_model
from safetensors.torch import save_file

from k3.checkpoint import from_pretrained, inspect

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def _mxfp4_fixture(out: int, inp: int, gen: torch.Generator):
    """Random FP4 codes and E8M0 scales, packed by hand (even element in the low nibble), and the
    values they stand for, decoded here from the OCP MX definition."""
    codes = torch.randint(0, 16, (out, inp), generator=gen, dtype=torch.uint8)
    scales = torch.randint(120, 131, (out, inp // 32), generator=gen, dtype=torch.uint8)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    mag = E2M1[(codes & 7).long()]
    sign = torch.where(codes & 8 > 0, -1.0, 1.0)
    scale = torch.pow(2.0, scales.double() - 127).float().repeat_interleave(32, dim=1)
    return packed, scales, sign * mag * scale


def _write_release(directory, model):
    cfg = model.config
    text = cfg.to_text_dict()
    wrapper = {"model_type": "kimi_k3", "architectures": ["KimiK3ForConditionalGeneration"],
               "text_config": text, "vision_config": {"model_type": "moonvit", "hidden_size": 32}}
    (directory / "config.json").write_text(json.dumps(wrapper))
    gen = torch.Generator().manual_seed(3)
    tensors, experts = {}, {}
    nh = cfg.linear_attn_config.num_heads
    for name, t in model.state_dict().items():
        if ".experts.w" in name:
            base, w = name.rsplit(".", 1)
            for e in range(t.shape[0]):
                packed, scale, value = _mxfp4_fixture(t.shape[1], t.shape[2], gen)
                key = f"language_model.{base}.{e}.{w}"
                tensors[key + ".weight_packed"], tensors[key + ".weight_scale"] = packed, scale
                experts[(name, e)] = value
        elif name.endswith(".A_log"):
            padded = torch.full((128,), 99.0)
            padded[:nh] = t
            tensors["language_model." + name] = padded
        elif name.endswith(("_conv1d.weight", ".dt_bias", ".o_norm.weight", ".e_score_correction_bias")):
            tensors["language_model." + name] = t.float().contiguous()
        else:
            tensors["language_model." + name] = t.to(torch.bfloat16).contiguous()
    tensors["vision_tower.encoder.blocks.0.attn.qkv.weight"] = torch.randn(96, 32).to(torch.bfloat16)
    tensors["multi_modal_projector.linear_1.weight"] = torch.randn(64, 128).to(torch.bfloat16)
    names = sorted(tensors)
    half = len(names) // 2
    weight_map = {}
    for i, part in enumerate((names[:half], names[half:]), 1):
        shard = f"model-{i:05d}-of-00002.safetensors"
        save_file({n: tensors[n] for n in part}, str(directory / shard), metadata={"format": "pt"})
        weight_map.update({n: shard for n in part})
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return experts


def test_release_layout_loads_dequantizes_and_runs(tmp_path, caplog):
    src = random_model("nano")
    experts = _write_release(tmp_path, src)
    with caplog.at_level(logging.INFO, logger="k3.checkpoint"):
        model = from_pretrained(tmp_path)
    assert "ignoring 2 vision/projector tensor(s)" in caplog.text
    sd = model.state_dict()
    assert sd["lm_head.weight"].dtype == torch.bfloat16  # the checkpoint's dtype
    for (name, e), value in experts.items():
        assert torch.equal(sd[name][e].float(), value), (name, e)
    for name, t in src.state_dict().items():
        if name.endswith(".A_log"):
            assert torch.equal(sd[name], t), name  # first num_heads of the 128 stored
    assert model.config.vision_config == {"model_type": "moonvit", "hidden_size": 32}
    with torch.no_grad():
        logits = model(torch.randint(0, model.config.vocab_size, (1, 9))).logits
    assert logits.shape == (1, 9, model.config.vocab_size) and torch.isfinite(logits).all()
    text = inspect(tmp_path)
    assert "multimodal layout" in text and "ignored (vision/projector): 2 tensors" in text
    n_routed = sum(src.state_dict()[n].numel() for n in src.state_dict() if ".experts.w" in n)
    assert f"routed experts {n_routed:,}" in text
