"""k3.config.presets: the named configurations, their known sizes, and keyword-only construction."""
import ast
import inspect

import pytest
import torch

import k3.config.presets as presets
from k3.config import PRESETS, K3Config, get_preset, list_presets
from k3.errors import ConfigError


def test_preset_names_and_reexports():
    assert list_presets() == ["nano", "tiny", "small", "kimi-linear-48b", "k3"]
    assert PRESETS is presets.PRESETS and presets.get_preset("nano").to_dict() == get_preset("nano").to_dict()


def test_kimi_linear_48b_has_the_released_parameter_counts():
    """Kimi-Linear-48B-A3B: 49,122,681,728 weights in the checkpoint (router biases included),
    3,106,972,544 active per token (8 of 256 routed experts, no input embedding)."""
    cfg = get_preset("kimi-linear-48b")
    from k3.model.decoder import K3ForCausalLM
    with torch.device("meta"):
        model = K3ForCausalLM(cfg)
    total = sum(t.numel() for t in model.state_dict().values())
    assert total == 49_122_681_728
    moe_layers = cfg.num_hidden_layers - cfg.first_k_dense_replace
    unused = moe_layers * (cfg.num_experts - cfg.num_experts_per_token) * 3 * cfg.hidden_size \
        * cfg.moe_intermediate_size
    assert total - unused - cfg.vocab_size * cfg.hidden_size == 3_106_972_544


@pytest.mark.parametrize("name", ["nano", "tiny", "small"])
def test_small_presets_keep_k3_shape(name):
    c = get_preset(name)
    n = c.num_hidden_layers
    assert c.mla_layer_ids == [l for l in range(n) if (l + 1) % 4 == 0 or l == n - 1]
    assert c.first_k_dense_replace == 1 and c.num_shared_experts == 1
    assert c.uses_latent_moe and c.hidden_act == "situ" and c.attn_res_block_size is not None
    assert c.linear_attn_config.num_heads == c.num_attention_heads


def test_each_call_builds_a_fresh_config():
    a = get_preset("nano")
    a.linear_attn_config.kda_layers.append(99)
    a.extra["x"] = 1
    b = get_preset("nano")
    assert 99 not in b.linear_attn_config.kda_layers and "x" not in b.extra


def test_overrides_are_validated_and_applied():
    assert get_preset("nano", hidden_act="silu").hidden_act == "silu"
    with pytest.raises(ConfigError, match="hidden_act"):
        get_preset("nano", hidden_act="relu")
    with pytest.raises(ConfigError, match="unknown preset 'k4'"):
        get_preset("k4")


def test_presets_are_written_with_keyword_arguments():
    """Every config-building call in k3/config/presets.py names its numbers (no positional arguments)."""
    tree = ast.parse(inspect.getsource(presets))
    calls = [node for node in ast.walk(tree) if isinstance(node, ast.Call)
             and getattr(node.func, "id", "") in ("K3Config", "LinearAttnConfig", "_small")]
    assert len(calls) >= 8
    assert all(not c.args for c in calls), [ast.unparse(c)[:60] for c in calls if c.args]


@pytest.mark.parametrize("name", list_presets())
def test_every_preset_is_a_valid_config(name):
    c = PRESETS[name]()
    assert isinstance(c, K3Config)
    assert K3Config.from_dict(c.to_dict()).to_dict() == c.to_dict()
