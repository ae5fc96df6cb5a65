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
    assert c.replace(rms_norm_eps=1e-6).extra["eos_token_ids"] == [5, 7]
    assert "eos_token_ids" not in c.replace(eos_token_id=9).extra  # no stale list left behind


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


# --------------------------------------------------------------------------- every field read or refused
# For each schema field of the nano preset: a change that must alter the model built from it (its
# parameter shapes, or its logits on fixed input with the same seed), or a value that is refused.
_NANO_LAC = get_preset("nano").linear_attn_config.to_dict()
CHANGES_MODEL = {
    "vocab_size": 600, "hidden_size": 48, "num_attention_heads": 4, "q_lora_rank": None,
    "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 8,
    "mla_use_output_gate": False, "mla_latent_norm_eps": 10.0, "intermediate_size": 96,
    "first_k_dense_replace": 2, "num_experts": 4, "num_experts_per_token": 3, "num_shared_experts": 0,
    "moe_intermediate_size": 16, "routed_expert_hidden_size": None, "latent_moe_use_norm": False,
    "moe_router_activation_func": "softmax", "moe_renormalize": False, "routed_scaling_factor": 2.5,
    "num_expert_group": 4, "topk_group": 2, "hidden_act": "silu", "activation_situ_beta": 1.0,
    "activation_situ_linear_beta": 0.5, "attn_res_block_size": None, "rms_norm_eps": 1.0,
    "tie_word_embeddings": True, "initializer_range": 0.2,
    "num_hidden_layers": 5,  # with the layer lists below
    "linear_attn_config": {**_NANO_LAC, "kda_layers": [1, 3], "full_attn_layers": [2, 4]},
    "linear_attn_config.num_heads": 4, "linear_attn_config.head_dim": 16,
    "linear_attn_config.short_conv_kernel_size": 3, "linear_attn_config.gate_lower_bound": None,
    "linear_attn_config.use_full_rank_gate": False,
}
BASE_FOR = {"topk_group": {"num_expert_group": 4}}  # topk_group is read with more than one group
REFUSED = {"mla_use_nope": False, "num_nextn_predict_layers": 1}
# Read outside the model: max_position_embeddings bounds the input length (checked below); the
# token ids are tokenizer metadata for HF generation; model_type selects the Kimi-Linear defaults
# when parsing (tests/test_config_hf.py).
READ_ELSEWHERE = {"max_position_embeddings", "bos_token_id", "eos_token_id", "pad_token_id", "model_type"}


def _changed(field: str, value):
    if field.startswith("linear_attn_config."):
        return {"linear_attn_config": {**_NANO_LAC, field.split(".", 1)[1]: value}}
    if field == "num_hidden_layers":
        return {field: value, "linear_attn_config": {**_NANO_LAC, "kda_layers": [1, 2, 3, 4],
                                                    "full_attn_layers": [5]}}
    return {field: value}


def _signature(cfg):
    import torch

    from k3.model.decoder import K3ForCausalLM
    torch.manual_seed(0)
    model = K3ForCausalLM(cfg).eval()
    ids = torch.arange(12).remainder(500).view(2, 6)
    with torch.no_grad():
        logits = model(ids).logits
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    return shapes, logits


def test_the_field_table_covers_every_field():
    fields = set(K3Config.text_field_names()) | {f"linear_attn_config.{k}" for k in LinearAttnConfig._KNOWN}
    fields -= {"linear_attn_config.kda_layers", "linear_attn_config.full_attn_layers"}  # in "linear_attn_config"
    table = set(CHANGES_MODEL) | set(REFUSED) | READ_ELSEWHERE
    assert fields == table, (sorted(fields - table), sorted(table - fields))


@pytest.mark.parametrize("field", sorted(CHANGES_MODEL))
def test_each_field_changes_the_model(field):
    base_cfg = get_preset("nano", **BASE_FOR.get(field, {}))
    changed = base_cfg.replace(**_changed(field, CHANGES_MODEL[field]))
    assert changed.to_dict() != base_cfg.to_dict()
    (s0, y0), (s1, y1) = _signature(base_cfg), _signature(changed)
    assert s0 != s1 or y0.shape != y1.shape or not (y0 - y1).abs().max() < 1e-6, field


@pytest.mark.parametrize("field", sorted(REFUSED))
def test_each_unimplemented_field_is_refused(field):
    with pytest.raises(ConfigError, match=field):
        get_preset("nano", **{field: REFUSED[field]})
    assert get_preset("nano", **{field: getattr(get_preset("nano"), field)})  # default accepted


def test_max_position_embeddings_bounds_the_input():
    import torch

    from k3.model.decoder import K3ForCausalLM
    model = K3ForCausalLM(get_preset("nano", max_position_embeddings=8))
    assert model(torch.zeros(1, 8, dtype=torch.long)).logits.shape == (1, 8, 512)
    with pytest.raises(ValueError, match="max_position_embeddings=8"):
        model(torch.zeros(1, 9, dtype=torch.long))


def test_signature_of_one_config_is_reproducible():
    """Control for the table: two builds of one config agree, so a difference comes from the field."""
    (s0, y0), (s1, y1) = _signature(get_preset("nano")), _signature(get_preset("nano"))
    assert s0 == s1 and (y0 - y1).abs().max() == 0


def test_importing_the_configs_leaves_torch_unloaded_and_the_tower_eps_is_fp32s():
    """k3.threads sets OpenMP up before torch loads, so ``import k3`` (the configs) must not load
    torch; the vision tower's norm eps is written out as a number, and it is fp32's machine eps."""
    import subprocess
    import sys

    import torch

    from k3.config import TOWER_NORM_EPS

    r = subprocess.run([sys.executable, "-c", "import sys, k3, k3.config; print('torch' in sys.modules)"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "False", r.stderr
    assert TOWER_NORM_EPS == torch.finfo(torch.float32).eps
