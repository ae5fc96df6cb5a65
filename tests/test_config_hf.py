"""config.json formats (k3.config.hf): flat, transformers' layer_types form, kimi_k3
wrapper; Kimi-Linear defaults; real files written by transformers and by k3 load, replace() and
write back with their extra keys untouched."""
import json

import pytest
from transformers import KimiLinearConfig

from k3.config import K3Config, config_to_dict, get_preset
from k3.errors import ConfigError

SMALL_HF = dict(vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=16,
                q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
                num_local_experts=4, num_experts_per_tok=2, n_shared_experts=1, linear_head_dim=16,
                linear_num_heads=2, layer_types=["linear_attention"] * 3 + ["full_attention"],
                mlp_layer_types=["dense", "sparse", "sparse", "sparse"], pad_token_id=0, bos_token_id=1,
                eos_token_id=2, routed_scaling_factor=2.0)


def _transformers_dir(tmp_path, **kw):
    cfg = KimiLinearConfig(**{**SMALL_HF, **kw})
    cfg.architectures = ["KimiLinearForCausalLM"]
    cfg.save_pretrained(tmp_path)
    return tmp_path


def test_transformers_written_config_json_loads_with_its_values(tmp_path):
    d = _transformers_dir(tmp_path)
    saved = json.loads((d / "config.json").read_text())
    assert "layer_types" in saved and "linear_attn_config" not in saved  # the form under test
    c = K3Config.from_json(d)
    assert (c.vocab_size, c.hidden_size, c.num_hidden_layers, c.num_attention_heads) == (128, 64, 4, 2)
    assert (c.num_experts, c.num_experts_per_token, c.num_shared_experts) == (4, 2, 1)
    assert c.kda_layer_ids == [0, 1, 2] and c.mla_layer_ids == [3] and c.first_k_dense_replace == 1
    assert (c.linear_attn_config.num_heads, c.linear_attn_config.head_dim) == (2, 16)
    assert c.routed_scaling_factor == 2.0 and c.latent_norm_eps == 1e-6 and c.hidden_act == "silu"
    assert c.linear_attn_config.gate_lower_bound is None and not c.linear_attn_config.use_full_rank_gate
    assert c.routed_expert_hidden_size is None and c.attn_res_block_size is None


def test_replace_on_a_transformers_config_keeps_extra_keys(tmp_path):
    d = _transformers_dir(tmp_path)
    saved = json.loads((d / "config.json").read_text())
    c = K3Config.from_json(d).replace(rms_norm_eps=1e-6, num_experts_per_token=3)
    out = c.to_dict()
    assert out["rms_norm_eps"] == 1e-6 and out["num_experts_per_token"] == 3
    for key in ("architectures", "transformers_version", "use_cache", "pretraining_tp"):
        assert key in saved and out[key] == saved[key], key
    # the layer_types / alias views are not carried stale: transformers reads k3's form back
    back = KimiLinearConfig.from_dict(out)
    assert back.num_experts_per_token == 3 and back.rms_norm_eps == 1e-6
    assert back.layer_types == saved["layer_types"] and back.mlp_layer_types == saved["mlp_layer_types"]
    assert back.linear_num_heads == 2 and back.linear_head_dim == 16


def test_transformers_config_round_trips_through_k3_into_transformers(tmp_path):
    d = _transformers_dir(tmp_path, q_lora_rank=24)
    out = K3Config.from_json(d).to_dict()
    back = KimiLinearConfig.from_dict(out).to_dict()
    ref = KimiLinearConfig.from_pretrained(d).to_dict()
    for key in ("vocab_size", "hidden_size", "q_lora_rank", "num_experts", "num_experts_per_token",
                "layer_types", "mlp_layer_types", "linear_num_heads", "model_max_length", "eos_token_id"):
        assert back[key] == ref[key], key


def test_k3_written_config_json_replace_and_model_config_dir(tmp_path):
    from k3.checkpoint import save_pretrained
    from k3.model.decoder import K3ForCausalLM
    from k3.train.config import TrainConfig, resolve_model_config

    save_pretrained(K3ForCausalLM(get_preset("nano")), tmp_path / "ckpt")
    path = tmp_path / "ckpt" / "config.json"
    d = json.loads(path.read_text())
    d.update(architectures=["K3ForCausalLM"], torch_dtype="bfloat16",
             auto_map={"AutoConfig": "configuration_k3.K3Config"})
    path.write_text(json.dumps(d))
    c = K3Config.from_json(tmp_path / "ckpt").replace(hidden_act="silu")
    assert c.hidden_act == "silu" and c.to_dict()["auto_map"] == d["auto_map"]
    assert c.to_dict()["torch_dtype"] == "bfloat16"
    tc = TrainConfig(model_config=str(tmp_path / "ckpt"), model_overrides={"rms_norm_eps": 1e-6},
                     hidden_act="silu", curriculum=[[0, 64]])
    tc.validate()
    cfg = resolve_model_config(tc)
    assert (cfg.rms_norm_eps, cfg.hidden_act, cfg.hidden_size) == (1e-6, "silu", 64)
    assert cfg.extra["architectures"] == ["K3ForCausalLM"]


def test_kimi_k3_wrapper_round_trip():
    text = get_preset("k3").to_text_dict()
    wrapper = {"model_type": "kimi_k3", "architectures": ["KimiK3ForConditionalGeneration"],
               "text_config": text, "vision_config": {"model_type": "moonvit", "hidden_size": 1152},
               "media_placeholder_token_id": 163605}
    c = K3Config.from_dict(wrapper)
    assert c.hidden_size == 7168 and c.vision_config["hidden_size"] == 1152
    assert c.to_dict() == wrapper and config_to_dict(c) == wrapper
    assert json.loads(c.to_json()) == wrapper


def test_kimi_linear_config_uses_one_indexed_lists_and_latent_eps():
    d = get_preset("kimi-linear-48b").to_text_dict()
    d.pop("mla_latent_norm_eps")
    c = K3Config.from_dict(d)
    assert c.mla_layer_ids == [3, 7, 11, 15, 19, 23, 26]
    assert c.latent_norm_eps == 1e-6


def _moonshot_style(model_type="kimi_linear"):
    return {"model_type": model_type, "vocab_size": 100, "hidden_size": 32, "num_hidden_layers": 4,
            "linear_attn_config": {"kda_layers": [1, 2, 3], "full_attn_layers": [4], "num_heads": 2,
                                   "head_dim": 16},
            "num_attention_heads": 2, "num_experts": 4, "num_experts_per_token": 2,
            "moe_intermediate_size": 16, "intermediate_size": 64, "kv_lora_rank": 16, "q_lora_rank": None,
            "model_max_length": 4096}


def test_kimi_linear_config_without_k3_fields_gets_kimi_linear_values():
    c = K3Config.from_dict(_moonshot_style())
    assert c.hidden_act == "silu" and c.routed_expert_hidden_size is None and c.attn_res_block_size is None
    assert not c.mla_use_output_gate and c.linear_attn_config.gate_lower_bound is None
    assert c.max_position_embeddings == 4096 and c.latent_norm_eps == 1e-6
    # model_type is what selects these defaults: another type keeps K3's
    other = K3Config.from_dict({**_moonshot_style("kimi_k3_text"), "routed_expert_hidden_size": 16})
    assert other.hidden_act == "situ" and other.mla_use_output_gate and other.attn_res_block_size == 12
    # a k3-written kimi_linear config carries every field and keeps its values
    k3 = get_preset("tiny")
    assert K3Config.from_dict(k3.to_dict()).to_dict() == k3.to_dict()


@pytest.mark.parametrize("change, message", [
    ({"layer_types": ["linear_attention", "mamba", "linear_attention", "full_attention"]}, "layer_types must be"),
    ({"layer_types": "full_attention"}, "layer_types must be"),
    ({"layer_types": ["full_attention"] * 3}, "layer_types has 3 entries"),
    ({"mlp_layer_types": ["sparse", "dense", "sparse", "sparse"]}, "dense layers must be a prefix"),
    ({"mlp_layer_types": ["dense", "moe", "sparse", "sparse"]}, "mlp_layer_types must be"),
    ({"mlp_layer_types": ["dense", "sparse", "sparse", "sparse"], "first_k_dense_replace": 2},
     "first_k_dense_replace=2"),
    ({"num_experts_per_tok": 3}, "num_experts_per_tok=3 disagrees with num_experts_per_token=2"),
    ({"attention_bias": True}, "attention_bias=True"),
    ({"attention_dropout": 0.1}, "attention_dropout=0.1"),
    ({"num_key_value_heads": 1}, "num_key_value_heads=1"),
    ({"qk_head_dim": 7}, "qk_head_dim=7"),
    ({"moe_layer_freq": 2}, "moe_layer_freq=2"),
    ({"topk_method": "greedy"}, "topk_method='greedy'"),
    ({"use_grouped_topk": False, "num_expert_group": 2}, "use_grouped_topk=false"),
    ({"linear_attn_config": {"kda_layers": [1, 2], "full_attn_layers": [3, 4]}},
     "layer_types disagrees with linear_attn_config.kda_layers"),
    ({"linear_num_heads": 4, "linear_attn_config": {"kda_layers": [1, 2, 3], "full_attn_layers": [4],
                                                    "num_heads": 2}}, "linear_num_heads=4 disagrees"),
])
def test_transformers_form_problems_are_named(change, message):
    d = {"model_type": "kimi_linear", "vocab_size": 100, "hidden_size": 32, "num_hidden_layers": 4,
         "layer_types": ["linear_attention"] * 3 + ["full_attention"], "linear_num_heads": 2,
         "linear_head_dim": 16, "num_attention_heads": 2, "num_experts": 4, "num_experts_per_token": 2,
         "moe_intermediate_size": 16, "intermediate_size": 64, "kv_lora_rank": 16, "q_lora_rank": None,
         "attention_bias": False, "attention_dropout": 0.0, "num_key_value_heads": 2, "qk_head_dim": 192,
         "moe_layer_freq": 1, "topk_method": "noaux_tc", "use_grouped_topk": True, "rope_theta": 1e4}
    c = K3Config.from_dict(d)  # positive control: the unchanged dict loads
    assert c.kda_layer_ids == [0, 1, 2] and c.num_experts_per_token == 2
    with pytest.raises(ConfigError, match=message):
        K3Config.from_dict({**d, **change})


def test_model_max_length_beside_max_position_embeddings_passes_through():
    d = {**_moonshot_style(), "max_position_embeddings": 2048}
    c = K3Config.from_dict(d)
    assert c.max_position_embeddings == 2048 and c.extra["model_max_length"] == 4096
    assert K3Config.from_dict(_moonshot_style()).max_position_embeddings == 4096  # alone: it is the length
