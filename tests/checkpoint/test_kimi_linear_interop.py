"""A Kimi-Linear checkpoint written by transformers' save_pretrained loads into k3 and gives
transformers' logits (transformers' pure-PyTorch kimi_linear is the independent reference)."""
import json

import pytest
import torch
from safetensors import safe_open
from transformers import KimiLinearConfig, KimiLinearForCausalLM  # noqa: E402

from k3.checkpoint import from_pretrained, inspect, load_state_dict, save_pretrained  # noqa: E402
from k3.config import get_preset
from k3.model.decoder import K3ForCausalLM


def _hf_model(q_lora_rank):
    cfg = KimiLinearConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
        num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=16, q_lora_rank=q_lora_rank,
        qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, num_local_experts=4, num_experts_per_tok=2,
        n_shared_experts=1, linear_head_dim=16, linear_num_heads=2,
        layer_types=["linear_attention"] * 3 + ["full_attention"],
        mlp_layer_types=["dense", "sparse", "sparse", "sparse"], pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = KimiLinearForCausalLM(cfg).eval()
    with torch.no_grad():  # norms and router biases are constant at init; make them informative
        for name, p in model.named_parameters():
            if name.endswith(("norm.weight", "layernorm.weight")):
                p.add_(torch.randn_like(p) * 0.1)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn_like(b) * 0.05)
    return model


@pytest.mark.parametrize("q_lora_rank", [None, 24])
def test_transformers_checkpoint_gives_transformers_logits(tmp_path, q_lora_rank):
    hf = _hf_model(q_lora_rank)
    hf.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert "layer_types" in saved and "linear_attn_config" not in saved  # the layout under test
    model = from_pretrained(tmp_path, dtype=torch.float32).eval()
    cfg = model.config
    assert cfg.kda_layer_ids == [0, 1, 2] and cfg.mla_layer_ids == [3]
    assert cfg.routed_expert_hidden_size is None and cfg.attn_res_block_size is None
    assert not cfg.linear_attn_config.use_full_rank_gate and not cfg.mla_use_output_gate
    ids = torch.randint(3, 128, (2, 19), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids).logits
        got = model(ids).logits
    rel = (got - ref).norm() / ref.norm()
    assert rel <= 1e-5, f"relative error {rel:.3g}"


def test_transformers_checkpoint_reexports_in_k3_layout(tmp_path):
    hf = _hf_model(None)
    hf.save_pretrained(tmp_path / "hf")
    cfg, sd = load_state_dict(tmp_path / "hf")
    # dense layer-0 MLP stored under block_sparse_moe., A_log stored [1,1,H,1]
    assert torch.equal(sd["model.layers.0.mlp.gate_proj.weight"], hf.model.layers[0].mlp.gate_proj.weight)
    assert torch.equal(sd["model.layers.2.self_attn.A_log"], hf.model.layers[2].self_attn.forget_gate.A_log.flatten())
    F = cfg.moe_intermediate_size
    gate_up = hf.model.layers[1].mlp.experts.gate_up_proj  # transformers' fused runtime layout
    assert torch.equal(sd["model.layers.1.block_sparse_moe.experts.w1"], gate_up[:, :F])
    assert torch.equal(sd["model.layers.1.block_sparse_moe.experts.w3"], gate_up[:, F:])
    model = from_pretrained(tmp_path / "hf")
    save_pretrained(model, tmp_path / "k3")
    assert "3 KDA" in inspect(tmp_path / "k3")
    again = from_pretrained(tmp_path / "k3")
    for n, t in model.state_dict().items():
        assert torch.equal(t, again.state_dict()[n]), n


def _ids():
    return torch.randint(3, 128, (2, 19), generator=torch.Generator().manual_seed(1))


def _load_in_transformers(directory):
    """transformers' own loader; any missing / unexpected / mis-shaped tensor fails the test."""
    hf, info = KimiLinearForCausalLM.from_pretrained(directory, output_loading_info=True)
    assert not any(info.get(k) for k in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs")), info
    return hf.eval()


def _k3_kimi_linear_model(seed=0):
    """A Kimi-Linear-mode model built by k3 from its preset (not from a transformers config), every
    tensor random so nothing can be silently dropped or reinitialised."""
    cfg = get_preset(
        "kimi-linear-48b", vocab_size=128, hidden_size=64, num_hidden_layers=4, intermediate_size=96,
        moe_intermediate_size=32, num_experts=4, num_experts_per_token=2, num_attention_heads=2,
        kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, pad_token_id=0,
        bos_token_id=1, eos_token_id=2,
        linear_attn_config={"kda_layers": [1, 2, 3], "full_attn_layers": [4], "num_heads": 2, "head_dim": 16,
                            "short_conv_kernel_size": 4, "gate_lower_bound": None, "use_full_rank_gate": False})
    torch.manual_seed(seed)
    model = K3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, t in model.state_dict().items():
            scale = 0.3 if name.endswith(("A_log", "dt_bias")) else 0.05
            t.add_(torch.randn_like(t) * scale)
    return model


def test_k3_saved_kimi_linear_loads_in_transformers_with_equal_logits(tmp_path):
    model = _k3_kimi_linear_model()
    assert model.config.model_type == "kimi_linear"
    save_pretrained(model, tmp_path)
    with safe_open(str(next(tmp_path.glob("model-*.safetensors"))), "pt") as f:
        assert list(f.get_slice("model.layers.0.self_attn.A_log").get_shape()) == [1, 1, 2, 1]
        assert list(f.get_slice("model.layers.0.self_attn.dt_bias").get_shape()) == [2 * 16]
    hf = _load_in_transformers(tmp_path)
    with torch.no_grad():
        ref, got = hf(_ids()).logits, model(_ids()).logits
    rel = (got - ref).norm() / ref.norm()
    assert rel <= 1e-5, f"relative error {rel:.3g}"
    again = from_pretrained(tmp_path)  # and k3 reads its own Kimi-Linear layout back exactly
    for n, t in model.state_dict().items():
        assert torch.equal(t, again.state_dict()[n]), n


def test_transformers_to_k3_to_transformers_gives_equal_logits(tmp_path):
    hf = _hf_model(24)
    hf.save_pretrained(tmp_path / "hf")
    model = from_pretrained(tmp_path / "hf")
    save_pretrained(model, tmp_path / "k3")
    back = _load_in_transformers(tmp_path / "k3")
    with torch.no_grad():
        assert torch.equal(back(_ids()).logits, hf(_ids()).logits)
    for n, t in hf.state_dict().items():
        assert torch.equal(t, back.state_dict()[n]), n


def test_k3_mode_models_keep_the_k3_a_log_layout(tmp_path):
    from checkpoint_models import random_model
    save_pretrained(random_model("nano"), tmp_path)  # latent MoE, AttnRes: not a Kimi-Linear model
    with safe_open(str(next(tmp_path.glob("model-*.safetensors"))), "pt") as f:
        assert list(f.get_slice("model.layers.0.self_attn.A_log").get_shape()) == [2]


def test_k3_architecture_checkpoints_do_not_claim_kimi_linear(tmp_path):
    """A K3-feature model is written under its own model_type, so transformers' Kimi-Linear loader
    is never handed a model it cannot run; the Kimi-Linear preset keeps its reference type."""
    from checkpoint_models import random_model
    save_pretrained(random_model("nano"), tmp_path / "k3")
    written = json.loads((tmp_path / "k3" / "config.json").read_text())
    assert written["model_type"] == "kimi_k3_text"
    assert "KimiLinearForCausalLM" not in written.get("architectures", [])
    # positive control: the Kimi-Linear preset is still labelled as the reference model
    assert get_preset("kimi-linear-48b").model_type == "kimi_linear"
    assert _k3_kimi_linear_model().config.model_type == "kimi_linear"


def test_kimi_linear_type_with_k3_features_is_refused_or_relabelled():
    from k3.config import K3Config
    from k3.errors import ConfigError
    with pytest.raises(ConfigError, match="attn_res_block_size"):
        get_preset("nano").replace(model_type="kimi_linear")
    # a config.json that an older k3 wrote (kimi_linear + explicit K3 fields) still loads, relabelled
    d = get_preset("nano").to_dict()
    d["model_type"] = "kimi_linear"
    assert K3Config.from_dict(d).model_type == "kimi_k3_text"
