"""`k3 quantize` (packed MXFP4 export) and packed inference (SPEC §3.7, §4).

Two references, both bit-exact (quantizing the same weights gives the same codes):
- weights-only checkpoints (input_activations null, the release's declaration): the source model
  with its expert weights rounded to MXFP4 (`_rounded`, written here with the ops-level
  quantize/dequantize) and nothing else changed;
- MXFP8-activation checkpoints (`k3 quantize` of a QAT model): the source model with `enable_qat`.
"""
import json
import re

import pytest
import torch
from checkpoint_models import random_model
from safetensors.torch import load_file, save_file

from k3.checkpoint import CheckpointError, from_pretrained, inspect, save_pretrained
from k3.checkpoint.names import mxfp4_quantization_config
from k3.checkpoint.quantize import quantize
from k3.cli.checkpoint import quantize_main
from k3.model.moe import RoutedExperts
from k3.model.mx_experts import FakeQuantMXExperts, PackedMXFP4Experts
from k3.ops.mx import dequantize_mx, quantize_mx
from k3.train.qat import enable_qat

INDEX = "model.safetensors.index.json"
EXPERT_FILE_RE = re.compile(r"\.experts\.\d+\.w[123]\.weight(_packed|_scale)?$")


@pytest.fixture(autouse=True)
def _one_thread():
    """These models are tiny; on a busy 2-core host intra-op threads only contend (100x slower)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _logits(model, seed=1, T=16):
    ids = torch.randint(0, model.config.vocab_size, (2, T), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return model.eval()(ids).logits


def _file_tensors(d):
    out = {}
    for shard in sorted(set(json.loads((d / INDEX).read_text())["weight_map"].values())):
        out.update(load_file(str(d / shard)))
    return out


def _experts(model):
    return [m for m in model.modules() if isinstance(m, (RoutedExperts, PackedMXFP4Experts, FakeQuantMXExperts))]


def _rounded(model):
    """Weights-only reference: every routed-expert weight replaced by its MXFP4 value, in place."""
    with torch.no_grad():
        for m in model.modules():
            if type(m) is RoutedExperts:
                for w in (m.w1, m.w3, m.w2):
                    w.copy_(dequantize_mx(*quantize_mx(w.float(), "fp4_e2m1", 32), "fp4_e2m1", 32,
                                          dtype=torch.float32).to(w.dtype))
    return model


@pytest.mark.parametrize("preset", ["nano", "tiny"])
def test_weights_only_packed_checkpoint_gives_the_rounded_weight_logits(tmp_path, preset):
    src = random_model(preset)
    save_pretrained(src, tmp_path / "src")
    quantize(tmp_path / "src", tmp_path / "q", dtype=torch.float32)
    qc = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]
    assert qc["config_groups"]["group_0"]["input_activations"] is None  # a plain model: weights-only
    packed = from_pretrained(tmp_path / "q")  # packed by default: config declares it
    assert all(isinstance(m, PackedMXFP4Experts) for m in _experts(packed)) and _experts(packed)
    ref = _logits(_rounded(src))
    assert torch.equal(_logits(packed), ref)
    enable_qat(src)  # the activation fake-quant is a real difference, so it must not be applied
    assert not torch.equal(_logits(src), ref)


@pytest.mark.parametrize("preset", ["nano", "tiny"])
def test_mxfp8_packed_checkpoint_gives_exactly_the_qat_logits(tmp_path, preset):
    src = random_model(preset)
    save_pretrained(src, tmp_path / "src")
    quantize(tmp_path / "src", tmp_path / "q", dtype=torch.float32, activations="mxfp8")
    acts = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"][
        "config_groups"]["group_0"]["input_activations"]
    assert (acts["num_bits"], acts["type"], acts["strategy"], acts["group_size"]) == (8, "float", "group", 32)
    packed = from_pretrained(tmp_path / "q")
    enable_qat(src)
    assert torch.equal(_logits(packed), _logits(src))


def test_default_bf16_export_matches_the_rounded_bf16_model(tmp_path):
    save_pretrained(random_model("nano", seed=2), tmp_path / "src", dtype=torch.bfloat16)
    quantize(tmp_path / "src", tmp_path / "q")  # default dtype bf16
    files = _file_tensors(tmp_path / "q")
    for name, t in files.items():
        if EXPERT_FILE_RE.search(name):
            assert t.dtype == torch.uint8, name
        elif name.endswith(("_conv1d.weight", ".A_log", ".dt_bias", ".o_norm.weight", ".e_score_correction_bias")):
            assert t.dtype == torch.float32, name
        else:
            assert t.dtype == torch.bfloat16, name
    ref = _rounded(from_pretrained(tmp_path / "src"))
    assert torch.equal(_logits(from_pretrained(tmp_path / "q")), _logits(ref))


def test_packed_load_copies_the_stored_bytes_without_dequantizing(tmp_path, monkeypatch):
    save_pretrained(random_model("nano"), tmp_path / "src")
    quantize(tmp_path / "src", tmp_path / "q")
    import k3.checkpoint.load as load_mod

    def no_dequant(*a, **k):
        raise AssertionError("packed experts were dequantized at load")

    monkeypatch.setattr(load_mod, "_dequant", no_dequant)
    model = from_pretrained(tmp_path / "q", keep_packed=True)
    assert not [n for n, _ in model.named_parameters() if ".experts." in n]  # no float expert copy
    files = _file_tensors(tmp_path / "q")
    sd = model.state_dict()
    n = 0
    for name, t in files.items():
        m = re.match(r"(.*\.experts)\.(\d+)\.(w[123])\.weight_(packed|scale)$", name)
        if m:
            assert torch.equal(sd[f"{m[1]}.{m[3]}_{m[4]}"][int(m[2])], t), name
            n += 1
    assert n == 2 * 3 * sum(e.num_experts for e in _experts(model))


def test_quantize_load_save_keeps_packed_bytes_identical(tmp_path):
    save_pretrained(random_model("nano", seed=3), tmp_path / "src")
    shards = quantize(tmp_path / "src", tmp_path / "q", max_shard_size="100KB")
    assert len(shards) > 1
    model = from_pretrained(tmp_path / "q")
    again = save_pretrained(model, tmp_path / "again", max_shard_size="100KB")
    assert again == shards
    for f in shards + ["config.json", INDEX]:
        assert (tmp_path / "again" / f).read_bytes() == (tmp_path / "q" / f).read_bytes(), f


def test_keep_packed_false_dequantizes_and_saves_a_plain_checkpoint(tmp_path):
    save_pretrained(random_model("nano", seed=4), tmp_path / "src")
    quantize(tmp_path / "src", tmp_path / "q", dtype=torch.float32)
    packed = from_pretrained(tmp_path / "q")
    plain = from_pretrained(tmp_path / "q", keep_packed=False)
    assert all(type(m) is RoutedExperts for m in _experts(plain))
    for p, f in zip(_experts(packed), _experts(plain)):
        for w, ref in zip(("w1", "w3", "w2"), p.expert_weights()):
            assert torch.equal(getattr(f, w), ref)
    assert torch.equal(_logits(plain), _logits(packed))  # weights-only: no activation fake-quant
    save_pretrained(plain, tmp_path / "plain")
    assert "quantization_config" not in json.loads((tmp_path / "plain" / "config.json").read_text())
    assert not any(n.endswith(("_packed", "_scale")) for n in _file_tensors(tmp_path / "plain"))


def _several_moe_layers(seed):
    """A K3-layout random model with six MoE layers (latent MoE, AttnRes, KDA + MLA), routers spread
    so experts see varied tokens: differences between the two loads would compound over layers."""
    model = random_model("nano", seed=seed, num_hidden_layers=8, linear_attn_config={
        "kda_layers": [1, 2, 3, 5, 6, 7], "full_attn_layers": [4, 8], "num_heads": 2, "head_dim": 32,
        "short_conv_kernel_size": 4, "gate_lower_bound": -5.0, "use_full_rank_gate": False})
    with torch.no_grad():
        for moe in model.moe_layers():
            moe.gate.weight.normal_(0.0, 0.5)
    return model


@pytest.mark.parametrize("activations", ["none", "mxfp8"])
def test_keep_packed_true_and_false_give_identical_logits(tmp_path, activations):
    src = _several_moe_layers(seed=7)
    assert len(src.moe_layers()) >= 6
    save_pretrained(src, tmp_path / "src")
    quantize(tmp_path / "src", tmp_path / "q", dtype=torch.float32, activations=activations)
    packed = from_pretrained(tmp_path / "q", keep_packed=True)
    plain = from_pretrained(tmp_path / "q", keep_packed=False)
    assert all(isinstance(m, PackedMXFP4Experts) for m in _experts(packed))
    assert not any(isinstance(m, PackedMXFP4Experts) for m in _experts(plain))
    ids = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        a, b = packed.eval()(ids).logits, plain.eval()(ids).logits
    assert torch.equal(a, b)
    # the reference for each declaration, built from the source model independently of the loaders
    ref = _rounded(src) if activations == "none" else (enable_qat(src), src)[1]
    with torch.no_grad():
        assert torch.equal(a, ref.eval()(ids).logits)


def test_release_layout_weights_only_loads_identically_packed_and_dequantized(tmp_path):
    from test_release_layout import _write_release
    (tmp_path / "rel").mkdir()
    _write_release(tmp_path / "rel", _several_moe_layers(seed=8))
    cfg = json.loads((tmp_path / "rel" / "config.json").read_text())
    cfg["quantization_config"] = mxfp4_quantization_config()  # what the release declares: weights-only
    (tmp_path / "rel" / "config.json").write_text(json.dumps(cfg))
    packed = from_pretrained(tmp_path / "rel", dtype=torch.float32)
    plain = from_pretrained(tmp_path / "rel", dtype=torch.float32, keep_packed=False)
    assert all(isinstance(m, PackedMXFP4Experts) for m in _experts(packed)) and _experts(packed)
    assert all(type(m) is RoutedExperts for m in _experts(plain))
    assert torch.equal(_logits(packed), _logits(plain))


def test_keep_packed_on_a_float_checkpoint_quantizes_at_load(tmp_path):
    save_pretrained(random_model("nano", seed=5), tmp_path / "src")
    quantize(tmp_path / "src", tmp_path / "q", dtype=torch.float32)
    on_load = from_pretrained(tmp_path / "src", keep_packed=True)
    from_file = from_pretrained(tmp_path / "q")
    assert on_load.state_dict().keys() == from_file.state_dict().keys()
    for k, v in from_file.state_dict().items():
        assert torch.equal(on_load.state_dict()[k], v), k
    assert all(type(m) is RoutedExperts for m in _experts(from_pretrained(tmp_path / "src")))


@pytest.mark.parametrize("preset", ["nano", "tiny"])
def test_packed_expert_bytes_are_4_25_bits_per_weight(tmp_path, preset):
    src = random_model(preset).to(torch.bfloat16)
    bf16 = sum(t.numel() * t.element_size() for m in _experts(src) for t in (m.w1, m.w2, m.w3))
    save_pretrained(src, tmp_path / "src")
    quantize(tmp_path / "src", tmp_path / "q")
    model = from_pretrained(tmp_path / "q")
    packed = sum(m.nbytes() for m in _experts(model))
    assert abs(packed / (bf16 * 4.25 / 16) - 1) < 0.02
    # nothing else holds expert weights: the model is the unquantized rest plus the packed bytes
    plain = from_pretrained(tmp_path / "src")
    rest = sum(t.numel() * t.element_size() for n, t in plain.state_dict().items() if ".experts.w" not in n)
    total = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    assert total == rest + packed


def _edit(d, name, fn):
    idx = json.loads((d / INDEX).read_text())
    shard = idx["weight_map"][name]
    tensors = load_file(str(d / shard))
    fn(tensors)
    save_file(tensors, str(d / shard), metadata={"format": "pt"})
    idx["weight_map"] = {k: v for k, v in idx["weight_map"].items() if v != shard} | {k: shard for k in tensors}
    idx["metadata"].pop("sha256")  # a hand-edited checkpoint: no longer k3's bytes
    (d / INDEX).write_text(json.dumps(idx))
    return d / shard


@pytest.fixture
def packed_ckpt(tmp_path):
    save_pretrained(random_model("nano"), tmp_path / "src")
    quantize(tmp_path / "src", tmp_path / "q")
    return tmp_path / "q"


@pytest.mark.parametrize("keep_packed", [True, False])
def test_packed_weight_of_wrong_shape_is_named(packed_ckpt, keep_packed):
    name = "model.layers.1.block_sparse_moe.experts.3.w2.weight_packed"
    shard = _edit(packed_ckpt, name, lambda t: t.__setitem__(name, t[name][:, :-1].contiguous()))
    with pytest.raises(CheckpointError) as e:
        from_pretrained(packed_ckpt, keep_packed=keep_packed)
    assert str(shard) in str(e.value) and f"{name}': shape [32, 15], expected [32, 16]" in str(e.value)


@pytest.mark.parametrize("keep_packed", [True, False])
def test_missing_scale_is_named(packed_ckpt, keep_packed):
    name = "model.layers.2.block_sparse_moe.experts.0.w1.weight_scale"
    _edit(packed_ckpt, name, lambda t: t.pop(name))
    with pytest.raises(CheckpointError, match=f"{packed_ckpt}: missing tensor {re.escape(name)}"):
        from_pretrained(packed_ckpt, keep_packed=keep_packed)


def test_float_scale_is_rejected_naming_the_tensor(packed_ckpt):
    name = "model.layers.3.block_sparse_moe.experts.7.w3.weight_scale"
    _edit(packed_ckpt, name, lambda t: t.__setitem__(name, t[name].float()))
    with pytest.raises(CheckpointError, match=re.escape(name) + "'.*must be uint8"):
        from_pretrained(packed_ckpt)


def test_packed_model_rejects_a_float_checkpoint_in_load_checkpoint(packed_ckpt, tmp_path):
    from k3.checkpoint import load_checkpoint
    model = from_pretrained(packed_ckpt)
    with pytest.raises(CheckpointError, match=r"missing tensor .*experts\.0\.w1\.weight_packed"):
        load_checkpoint(model, tmp_path / "src")


def _ct_quantized(qc, module, is_linear):
    """compressed-tensors' rule, written from its documentation: a module is quantized when a
    group target matches (class name, exact name, or "re:" + re.match) and no ignore entry does."""
    def hit(t):
        return re.match(t[3:], module) is not None if t.startswith("re:") else t == module or (t == "Linear" and is_linear)
    targeted = any(hit(t) for g in qc["config_groups"].values() for t in g["targets"])
    return targeted and not any(hit(t) for t in qc["ignore"])


@pytest.mark.parametrize("prefix", ["", "language_model."])
def test_quantization_config_selects_exactly_the_routed_experts(tmp_path, prefix):
    save_pretrained(random_model("nano"), tmp_path / "src")
    quantize(tmp_path / "src", tmp_path / "q")
    qc = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]
    assert qc == mxfp4_quantization_config()
    assert qc["format"] == "mxfp4-pack-quantized" and qc["quant_method"] == "compressed-tensors"
    w = qc["config_groups"]["group_0"]["weights"]
    assert (w["num_bits"], w["type"], w["group_size"], w["strategy"]) == (4, "float", 32, "group")
    plain = _file_tensors(tmp_path / "src")
    modules = {n.removesuffix(".weight"): t.dim() == 2 and "embed_tokens" not in n for n, t in plain.items()}
    quantized = {m for m, lin in modules.items() if _ct_quantized(qc, prefix + m, lin)}
    experts = {m for m in modules if re.search(r"\.experts\.\d+\.w[123]$", m)}
    assert experts and quantized == experts


def test_release_layout_bytes_are_carried_over_unchanged(tmp_path):
    from test_release_layout import _write_release
    (tmp_path / "rel").mkdir()
    _write_release(tmp_path / "rel", random_model("nano"))
    quantize(tmp_path / "rel", tmp_path / "q")
    src, out = _file_tensors(tmp_path / "rel"), _file_tensors(tmp_path / "q")
    packed = [n for n in out if n.endswith(("weight_packed", "weight_scale"))]
    assert packed and all(torch.equal(out[n], src["language_model." + n]) for n in packed)
    # a release config that declares the quantization (top level of the kimi_k3 wrapper) loads packed
    cfg = json.loads((tmp_path / "rel" / "config.json").read_text())
    cfg["quantization_config"] = mxfp4_quantization_config()
    (tmp_path / "rel" / "config.json").write_text(json.dumps(cfg))
    model = from_pretrained(tmp_path / "rel")
    assert all(isinstance(m, PackedMXFP4Experts) for m in _experts(model))
    assert "quantization_config" not in model.config.wrapper
    assert torch.equal(_logits(model), _logits(from_pretrained(tmp_path / "q", dtype=torch.bfloat16)))


def test_kimi_linear_checkpoint_quantizes(tmp_path):
    from test_kimi_linear_interop import _hf_model
    _hf_model(None).save_pretrained(tmp_path / "hf")
    quantize(tmp_path / "hf", tmp_path / "q", dtype=None)
    packed = from_pretrained(tmp_path / "q")
    assert _experts(packed) and all(isinstance(m, PackedMXFP4Experts) for m in _experts(packed))
    ref = _rounded(from_pretrained(tmp_path / "hf"))
    assert torch.equal(_logits(packed), _logits(ref))


def test_cli_writes_packed_checkpoint_and_inspect_shows_it(tmp_path, capsys):
    save_pretrained(random_model("nano"), tmp_path / "src")
    assert quantize_main([str(tmp_path / "src"), str(tmp_path / "q"), "--max-shard-size", "300KB"]) == 0
    assert "72 routed-expert matrices packed as MXFP4" in capsys.readouterr().out
    text = inspect(tmp_path / "q")
    assert "quantization_config: compressed-tensors mxfp4-pack-quantized (status compressed)" in text
    assert "group_0: targets ['Linear'], weights float4 group 32 (scale torch.uint8)" in text
    assert "ignore: re:.*lm_head$" in text and "packed MXFP4 experts: 72 matrices" in text
    assert re.search(r"24  uint8 +\[32, 16\] +model\.layers\.\{l\}\.block_sparse_moe\.experts\.\{e\}\.w1\.weight_packed", text)
    assert "quantization_config" not in inspect(tmp_path / "src")
    with pytest.raises(SystemExit):
        quantize_main([str(tmp_path / "src"), str(tmp_path / "src")])


def test_experts_that_do_not_fill_mx_blocks_are_refused(tmp_path):
    save_pretrained(random_model("nano", moe_intermediate_size=48), tmp_path / "src")
    with pytest.raises(ValueError, match="moe_intermediate_size F to be a multiple of 32, got 48"):
        quantize(tmp_path / "src", tmp_path / "q")
    assert not (tmp_path / "q").exists()

