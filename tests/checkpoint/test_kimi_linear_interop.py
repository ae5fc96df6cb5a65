"""A Kimi-Linear checkpoint written by transformers' save_pretrained loads into k3 and gives
transformers' logits (transformers' pure-PyTorch kimi_linear is the independent reference)."""
import json

import pytest
import torch
from transformers import KimiLinearConfig, KimiLinearForCausalLM  # noqa: E402

from k3.checkpoint import from_pretrained, inspect, load_state_dict, save_pretrained  # noqa: E402


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
