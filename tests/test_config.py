"""K3Config: schema, validation (every bad value a ConfigError naming the field), replace()."""
import json
import math

import pytest

from k3.config import K3Config, LinearAttnConfig, get_preset, list_presets
from k3.errors import ConfigError, K3Error


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


def test_error_types_keep_value_error_callers_working():
    assert issubclass(ConfigError, K3Error) and issubclass(ConfigError, ValueError)
    with pytest.raises(ValueError, match="kv_lora_rank"):
        get_preset("nano", kv_lora_rank=0)
    assert get_preset("nano", kv_lora_rank=16).kv_lora_rank == 16  # positive control


@pytest.mark.parametrize("change, message", [
    (dict(kda=[1, 2, 3], full=[3, 4]), "layer 3 listed as both KDA and MLA"),
    (dict(kda=[1, 2, 2], full=[4]), "layer 2 listed twice as KDA"),
    (dict(kda=[1, 2], full=[4]), r"layers \[3\]"),
    (dict(kda=[1, 2, 3], full=[5]), "MLA layer 5 is out of range"),
    (dict(kda=[0, 1, 2], full=[4]), "KDA layer 0 is out of range"),
    (dict(kda=[1, 2, "3"], full=[4]), "kda_layers entry must be an int"),
    (dict(kda={"1": 1}, full=[4]), "kda_layers must be a list"),
])
def test_bad_layer_lists_are_named(change, message):
    d = get_preset("nano").to_text_dict()
    d["linear_attn_config"]["kda_layers"] = change["kda"]
    d["linear_attn_config"]["full_attn_layers"] = change["full"]
    with pytest.raises(ConfigError, match=message):
        K3Config.from_dict(d)
    d["linear_attn_config"]["kda_layers"], d["linear_attn_config"]["full_attn_layers"] = [1, 2, 3], [4]
    assert K3Config.from_dict(d).mla_layer_ids == [3]  # positive control


NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize("field, value, message", [
    ("kv_lora_rank", 0, "kv_lora_rank must be > 0"),
    ("num_expert_group", 3, "divisible by num_expert_group"),
    ("num_experts_per_token", 9, "num_experts_per_token"),
    ("num_experts_per_token", 0, "num_experts_per_token must be > 0"),
    ("topk_group", 2, "topk_group"),
    ("hidden_act", "gelu", "hidden_act"),
    ("hidden_act", None, "hidden_act"),
    ("moe_router_activation_func", "relu", "moe_router_activation_func"),
    ("hidden_size", 1.5, "hidden_size must be an int"),
    ("hidden_size", True, "hidden_size must be an int"),
    ("hidden_size", "64", "hidden_size must be an int"),
    ("vocab_size", 2**40, "vocab_size must be <= 2147483647"),
    ("num_hidden_layers", 10**9, "num_hidden_layers must be <= 65536"),
    ("rms_norm_eps", NAN, "rms_norm_eps must be finite"),
    ("rms_norm_eps", INF, "rms_norm_eps must be finite"),
    ("rms_norm_eps", 0.0, "rms_norm_eps must be > 0"),
    ("rms_norm_eps", "1e-5", "rms_norm_eps must be a number"),
    ("activation_situ_beta", NAN, "activation_situ_beta must be finite"),
    ("activation_situ_beta", -1.0, "activation_situ_beta must be > 0"),
    ("activation_situ_linear_beta", -INF, "activation_situ_linear_beta must be finite"),
    ("routed_scaling_factor", NAN, "routed_scaling_factor must be finite"),
    ("routed_scaling_factor", 0.0, "routed_scaling_factor must be > 0"),
    ("initializer_range", INF, "initializer_range must be finite"),
    ("mla_latent_norm_eps", NAN, "mla_latent_norm_eps must be finite"),
    ("tie_word_embeddings", "false", "tie_word_embeddings must be true or false"),
    ("moe_renormalize", 0, "moe_renormalize must be true or false"),
    ("mla_use_output_gate", "no", "mla_use_output_gate must be true or false"),
    ("latent_moe_use_norm", 1, "latent_moe_use_norm must be true or false"),
    ("eos_token_id", -1, "eos_token_id must be >= 0"),
    ("model_type", 3, "model_type must be a string"),
    ("linear_attn_config", [], "linear_attn_config must be a JSON object"),
    ("linear_attn_config", "kda", "linear_attn_config must be a JSON object"),
])
def test_bad_fields_are_named(field, value, message):
    with pytest.raises(ConfigError, match=message):
        get_preset("nano", **{field: value})


@pytest.mark.parametrize("key, value, message", [
    ("num_heads", 0, "linear_attn_config.num_heads must be > 0"),
    ("head_dim", "32", "linear_attn_config.head_dim must be an int"),
    ("short_conv_kernel_size", 2.0, "linear_attn_config.short_conv_kernel_size must be an int"),
    ("gate_lower_bound", NAN, "linear_attn_config.gate_lower_bound must be finite"),
    ("gate_lower_bound", 1.0, "linear_attn_config.gate_lower_bound must be < 0"),
    ("use_full_rank_gate", "true", "linear_attn_config.use_full_rank_gate must be true or false"),
])
def test_bad_linear_attn_fields_are_named(key, value, message):
    d = get_preset("nano").to_text_dict()
    d["linear_attn_config"][key] = value
    with pytest.raises(ConfigError, match=message):
        K3Config.from_dict(d)


def test_json_booleans_are_not_cast(tmp_path):
    """A config.json saying "false" (a string) is refused, not read as true; real false is kept."""
    d = get_preset("nano").to_text_dict()
    p = tmp_path / "config.json"
    p.write_text(json.dumps({**d, "tie_word_embeddings": "false"}))
    with pytest.raises(ConfigError, match="config.json: tie_word_embeddings must be true or false"):
        K3Config.from_json(p)
    p.write_text(json.dumps({**d, "tie_word_embeddings": True}))
    assert K3Config.from_json(p).tie_word_embeddings is True


def test_nan_in_json_text_is_refused(tmp_path):
    p = tmp_path / "config.json"
    p.write_text(get_preset("nano").to_json().replace('"rms_norm_eps": 1e-05', '"rms_norm_eps": NaN'))
    assert "NaN" in p.read_text()
    with pytest.raises(ConfigError, match="rms_norm_eps must be finite"):
        K3Config.from_json(p)


@pytest.mark.parametrize("field, value, message", [
    ("mla_use_nope", False, "mla_use_nope=false .* not implemented"),
    ("num_nextn_predict_layers", 1, "num_nextn_predict_layers=1: multi-token prediction"),
])
def test_unimplemented_values_are_refused(field, value, message):
    with pytest.raises(ConfigError, match=message):
        get_preset("nano", **{field: value})


def test_malformed_json_names_the_file(tmp_path):
    p = tmp_path / "config.json"
    p.write_text("{not json")
    with pytest.raises(ConfigError, match="config.json"):
        K3Config.from_json(p)
    p.write_bytes(b"\xff\xfe{}")
    with pytest.raises(ConfigError, match="config.json: not valid JSON"):
        K3Config.from_json(p)


@pytest.mark.parametrize("d, message", [
    ([1, 2], "a config must be a JSON object"),
    ({"text_config": []}, "text_config must be a JSON object"),
    ({"eos_token_id": []}, "eos_token_id is an empty list"),
    ({"eos_token_id": ["a"]}, "eos_token_id entry must be an int"),
    ({"text_config": get_preset("nano").to_text_dict(), "vision_config": [1]},
     "vision_config must be a JSON object"),
])
def test_malformed_documents_are_config_errors(d, message):
    with pytest.raises(ConfigError, match=message):
        K3Config.from_dict(d)


def test_token_id_lists_keep_the_first_and_all(tmp_path):
    d = {**get_preset("nano").to_text_dict(), "eos_token_id": [5, 7]}
    c = K3Config.from_dict(d)
    assert c.eos_token_id == 5 and c.extra["eos_token_ids"] == [5, 7]


def test_unknown_preset_has_a_did_you_mean():
    with pytest.raises(ConfigError, match="unknown preset 'nanoo' \\(did you mean 'nano'\\?\\)"):
        get_preset("nanoo")


def test_replace_refuses_unknown_fields_with_a_suggestion():
    with pytest.raises(ConfigError, match="'hidden_sise' \\(did you mean 'hidden_size'\\?\\)"):
        get_preset("nano").replace(hidden_sise=32)
    assert get_preset("nano").replace(hidden_size=32).hidden_size == 32


def test_replace_keeps_extra_wrapper_and_vision_untouched():
    d = {**get_preset("nano").to_text_dict(), "architectures": ["KimiLinearForCausalLM"],
         "torch_dtype": "bfloat16", "auto_map": {"AutoConfig": "configuration_kimi.KimiLinearConfig"}}
    wrapped = {"model_type": "kimi_k3", "text_config": d, "vision_config": {"hidden_size": 8}, "k": 1}
    c = K3Config.from_dict(wrapped).replace(rms_norm_eps=1e-6)
    out = c.to_dict()
    assert out["text_config"]["rms_norm_eps"] == 1e-6
    assert {k: out["text_config"][k] for k in ("architectures", "torch_dtype", "auto_map")} == \
        {k: d[k] for k in ("architectures", "torch_dtype", "auto_map")}
    assert out["vision_config"] == {"hidden_size": 8} and out["k"] == 1 and out["model_type"] == "kimi_k3"
    # the copy is deep: editing it leaves the original alone
    c.extra["auto_map"]["AutoConfig"] = "x"
    assert K3Config.from_dict(wrapped).extra["auto_map"]["AutoConfig"] != "x"


def test_linear_attn_config_dict_is_converted():
    c = get_preset("nano")
    assert isinstance(c.linear_attn_config, LinearAttnConfig)
    c2 = c.replace(linear_attn_config=c.linear_attn_config.to_dict())
    assert c2.to_dict() == c.to_dict()
    assert c.replace(linear_attn_config=c.linear_attn_config).to_dict() == c.to_dict()


def test_fingerprint_changes_with_any_field():
    c = get_preset("nano")
    assert c.fingerprint() == get_preset("nano").fingerprint()
    assert c.fingerprint() != c.replace(rms_norm_eps=1e-6).fingerprint()
    assert math.isclose(c.latent_norm_eps, c.rms_norm_eps)
