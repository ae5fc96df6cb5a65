import json

import pytest

from k3.config import K3Config, LinearAttnConfig, get_preset, list_presets


def test_k3_preset_holds_released_numbers():
    c = get_preset("k3")
    assert (c.vocab_size, c.hidden_size, c.num_hidden_layers) == (163840, 7168, 93)
    assert len(c.kda_layer_ids) == 69 and len(c.mla_layer_ids) == 24
    assert c.mla_layer_ids[:3] == [3, 7, 11] and c.mla_layer_ids[-2:] == [91, 92]
    assert all((l + 1) % 4 != 0 for l in c.kda_layer_ids) and 92 not in c.kda_layer_ids
    assert (c.num_experts, c.num_experts_per_token, c.num_shared_experts) == (896, 16, 2)
    assert (c.routed_expert_hidden_size, c.moe_intermediate_size, c.attn_res_block_size) == (3584, 3072, 12)
    assert c.linear_attn_config.gate_lower_bound == -5.0 and c.hidden_act == "situ"


@pytest.mark.parametrize("name", list_presets())
def test_flat_config_json_round_trip(name, tmp_path):
    c = get_preset(name)
    p = tmp_path / "config.json"
    c.to_json(p)
    c2 = K3Config.from_json(p)
    assert c2.to_dict() == c.to_dict()
    assert K3Config.from_json(str(tmp_path)).to_dict() == c.to_dict()


def test_kimi_k3_wrapper_round_trip():
    text = get_preset("k3").to_text_dict()
    wrapper = {"model_type": "kimi_k3", "architectures": ["KimiK3ForConditionalGeneration"],
               "text_config": text, "vision_config": {"model_type": "moonvit", "hidden_size": 1152},
               "media_placeholder_token_id": 163605}
    c = K3Config.from_dict(wrapper)
    assert c.hidden_size == 7168 and c.vision_config["hidden_size"] == 1152
    assert c.to_dict() == wrapper
    assert json.loads(c.to_json()) == wrapper


def test_kimi_linear_config_uses_one_indexed_lists_and_latent_eps():
    d = get_preset("kimi-linear-48b").to_text_dict()
    d.pop("mla_latent_norm_eps")
    c = K3Config.from_dict(d)
    assert c.mla_layer_ids == [3, 7, 11, 15, 19, 23, 26]
    assert c.latent_norm_eps == 1e-6


def test_transformers_layer_types_config_is_accepted():
    d = {"model_type": "kimi_linear", "vocab_size": 100, "hidden_size": 32, "num_hidden_layers": 4,
         "layer_types": ["linear_attention"] * 3 + ["full_attention"],
         "mlp_layer_types": ["dense", "sparse", "sparse", "sparse"], "linear_num_heads": 2,
         "linear_head_dim": 16, "num_attention_heads": 2, "num_experts": 4, "num_experts_per_tok": 2,
         "moe_intermediate_size": 16, "intermediate_size": 64, "kv_lora_rank": 16, "q_lora_rank": None,
         "routed_expert_hidden_size": None, "attn_res_block_size": None, "hidden_act": "silu"}
    c = K3Config.from_dict(d)
    assert c.kda_layer_ids == [0, 1, 2] and c.mla_layer_ids == [3]
    assert c.first_k_dense_replace == 1 and c.num_experts_per_token == 2
    assert c.linear_attn_config.gate_lower_bound is None and not c.linear_attn_config.use_full_rank_gate


@pytest.mark.parametrize("change, message", [
    (dict(kda=[1, 2, 3], full=[3, 4]), "layer 3 listed as both KDA and MLA"),
    (dict(kda=[1, 2], full=[4]), r"layers \[3\]"),
    (dict(kda=[1, 2, 3], full=[5]), "MLA layer 5 is out of range"),
    (dict(kda=[0, 1, 2], full=[4]), "KDA layer 0 is out of range"),
])
def test_bad_layer_lists_are_named(change, message):
    d = get_preset("nano").to_text_dict()
    d["linear_attn_config"]["kda_layers"] = change["kda"]
    d["linear_attn_config"]["full_attn_layers"] = change["full"]
    with pytest.raises(ValueError, match=message):
        K3Config.from_dict(d)


@pytest.mark.parametrize("field, value, message", [
    ("kv_lora_rank", 0, "kv_lora_rank must be > 0"),
    ("num_expert_group", 3, "divisible by num_expert_group"),
    ("num_experts_per_token", 9, "num_experts_per_token"),
    ("hidden_act", "gelu", "hidden_act"),
    ("hidden_size", 1.5, "hidden_size must be an int"),
])
def test_bad_fields_are_named(field, value, message):
    with pytest.raises((ValueError, TypeError), match=message):
        get_preset("nano", **{field: value})


def test_malformed_json_names_the_file(tmp_path):
    p = tmp_path / "config.json"
    p.write_text("{not json")
    with pytest.raises(ValueError, match="config.json"):
        K3Config.from_json(p)


def test_unknown_preset():
    with pytest.raises(ValueError, match="unknown preset"):
        get_preset("k4")


def test_linear_attn_config_dict_is_converted():
    c = get_preset("nano")
    assert isinstance(c.linear_attn_config, LinearAttnConfig)
    c2 = c.replace(linear_attn_config=c.linear_attn_config.to_dict())
    assert c2.to_dict() == c.to_dict()


def test_kimi_linear_config_without_k3_fields_gets_kimi_linear_values():
    d = {"model_type": "kimi_linear", "vocab_size": 100, "hidden_size": 32, "num_hidden_layers": 4,
         "linear_attn_config": {"kda_layers": [1, 2, 3], "full_attn_layers": [4], "num_heads": 2,
                                "head_dim": 16},
         "num_attention_heads": 2, "num_experts": 4, "num_experts_per_token": 2, "moe_intermediate_size": 16,
         "intermediate_size": 64, "kv_lora_rank": 16, "q_lora_rank": None, "model_max_length": 4096}
    c = K3Config.from_dict(d)
    assert c.hidden_act == "silu" and c.routed_expert_hidden_size is None and c.attn_res_block_size is None
    assert not c.mla_use_output_gate and c.linear_attn_config.gate_lower_bound is None
    assert c.max_position_embeddings == 4096 and c.latent_norm_eps == 1e-6
    # a k3-written kimi_linear config carries every field and keeps its values
    k3 = get_preset("tiny")
    assert K3Config.from_dict(k3.to_dict()).to_dict() == k3.to_dict()
