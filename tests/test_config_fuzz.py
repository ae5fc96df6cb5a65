"""Fuzzing the config parsers (hypothesis): mutated config.json / run.toml dicts, random TOML text and
random `k3 train` flags either parse or raise a K3Error (never TypeError, KeyError, AttributeError,
IndexError, OverflowError...). Unmutated inputs parse and round-trip (the positive control)."""
import copy
import json
import math
import os
import tempfile

import pytest
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from k3.config import K3Config, get_preset, list_presets
from k3.errors import K3Error
from k3.cli.train import build_train_parser, train_config_from_args
from k3.train.config import TrainConfig, resolve_model_config

FUZZ = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])

NASTY = st.one_of(
    st.none(), st.booleans(), st.sampled_from(["", "false", "true", "no", "silu", "nan", "sigmoid"]),
    st.integers(-2**70, 2**70), st.sampled_from([0, -1, 1, 2, 4, 2**31, 2**63, 2**64]),
    st.floats(allow_nan=True, allow_infinity=True, allow_subnormal=False), st.sampled_from([float("nan"), float("inf")]),
    st.lists(st.integers(-3, 9), max_size=5), st.just([]), st.just([[]]),
    st.dictionaries(st.text(max_size=6), st.integers(-2, 5), max_size=2),
)


def _transformers_form() -> dict:
    return {"model_type": "kimi_linear", "vocab_size": 100, "hidden_size": 32, "num_hidden_layers": 4,
            "layer_types": ["linear_attention"] * 3 + ["full_attention"],
            "mlp_layer_types": ["dense", "sparse", "sparse", "sparse"], "linear_num_heads": 2,
            "linear_head_dim": 16, "num_attention_heads": 2, "num_local_experts": 4, "num_experts_per_tok": 2,
            "moe_intermediate_size": 16, "intermediate_size": 64, "kv_lora_rank": 16, "q_lora_rank": None,
            "architectures": ["KimiLinearForCausalLM"], "torch_dtype": "bfloat16", "eos_token_id": [2, 3]}


def _wrapper() -> dict:
    return {"model_type": "kimi_k3", "text_config": get_preset("nano").to_dict(),
            "vision_config": {"hidden_size": 8}, "media_placeholder_token_id": 5}


BASES = [get_preset(n).to_dict() for n in list_presets()] + [_transformers_form(), _wrapper()]
RUN_BASE = {"preset": "nano", "steps": 10, "batch_size": 2, "lr": 0.01, "qat": False, "attn_res": True,
            "curriculum": [[0, 16], [0.5, 32]], "model_overrides": {"hidden_act": "silu"}, "threads": 1,
            "seed": 3, "device": "cpu", "warmup_frac": 0.1, "optimizer": "adamw"}


def _dumps(d) -> str:
    return json.dumps(d, sort_keys=True)


@pytest.mark.parametrize("i", range(len(BASES)))
def test_unmutated_configs_parse_and_round_trip(i):
    c = K3Config.from_dict(copy.deepcopy(BASES[i]))
    again = K3Config.from_dict(c.to_dict())
    assert _dumps(again.to_dict()) == _dumps(c.to_dict()) and _dumps(c.replace().to_dict()) == _dumps(c.to_dict())


def test_unmutated_run_options_parse():
    tc = TrainConfig.build(overrides=copy.deepcopy(RUN_BASE))
    assert resolve_model_config(tc).hidden_act == "silu" and tc.attn_res is True


def _mutate(data, target: dict, keys: list[str]) -> None:
    op = data.draw(st.sampled_from(["set", "set", "delete", "add", "near_miss"]))
    key = data.draw(st.sampled_from(keys)) if keys else "x"
    if op == "set":
        target[key] = data.draw(NASTY)
    elif op == "delete":
        target.pop(key, None)
    elif op == "add":
        target[data.draw(st.text(min_size=1, max_size=12))] = data.draw(NASTY)
    else:  # a misspelled copy of a real key
        target[key + data.draw(st.sampled_from(["s", "_", "x"]))] = target.get(key)


@FUZZ
@given(st.data())
def test_mutated_config_json_gives_only_config_errors(data):
    d = copy.deepcopy(data.draw(st.sampled_from(BASES)))
    for _ in range(data.draw(st.integers(1, 3))):
        target = d
        if isinstance(d.get("text_config"), dict) and data.draw(st.booleans()):
            target = d["text_config"]
        if isinstance(target.get("linear_attn_config"), dict) and data.draw(st.booleans()):
            target = target["linear_attn_config"]
        _mutate(data, target, sorted(target))
    try:
        c = K3Config.from_dict(d)
    except K3Error:
        event("refused")
        return
    event("parsed")
    text = c.to_json()  # a config that parsed writes back and parses again to the same thing
    assert _dumps(K3Config.from_dict(json.loads(text)).to_dict()) == _dumps(c.to_dict())


@FUZZ
@given(st.data())
def test_mutated_run_options_give_only_config_errors(data):
    d = copy.deepcopy(RUN_BASE)
    fields = TrainConfig.field_names()
    for _ in range(data.draw(st.integers(1, 3))):
        if isinstance(d.get("model_overrides"), dict) and data.draw(st.booleans()):
            _mutate(data, d["model_overrides"], K3Config.text_field_names())
        else:
            _mutate(data, d, fields)
    try:
        tc = TrainConfig.build(overrides=d)
        cfg = resolve_model_config(tc)
    except K3Error:
        event("refused")
        return
    except FileNotFoundError as e:  # model_config / data set to a path that is not there
        assert d.get("model_config") is not None and str(d["model_config"]) in str(e)
        return
    event("parsed")
    assert isinstance(cfg, K3Config) and math.isfinite(tc.lr)
    assert TrainConfig.from_dict(tc.to_dict()).to_dict() == tc.to_dict()


@FUZZ
@given(st.text(max_size=200) | st.sampled_from(
    ['qat = "no"', "lr = nan", "seed = 1e20", "threads = 100000", "[model_overrides]\nx = 1",
     "curriculum = [[0, 16], [0.5, nan]]", 'device = "cuda:9"', "steps = 99999999999999999999"]))
def test_random_toml_text_gives_only_config_errors(text):
    fd, path = tempfile.mkstemp(suffix=".toml")
    try:
        with os.fdopen(fd, "w", encoding="utf-8", errors="surrogateescape") as f:
            f.write(text)
        try:
            TrainConfig.build(path)
        except K3Error:
            pass
    finally:
        os.remove(path)


_FLAGS = [s for a in build_train_parser()._actions for s in a.option_strings
          if s.startswith("--") and s not in ("--help", "--config", "--resume", "--model-config")]
_VALUES = st.sampled_from(["nan", "inf", "-1", "0", "1", "1e20", "100000", "cuda", "cpu", "nano", "x",
                           "0:16,0.5:32", "0:16,1.5:8", "18446744073709551616", ""])


@FUZZ
@given(st.lists(st.tuples(st.sampled_from(_FLAGS), _VALUES), max_size=4))
@example([("--seq-len", "16"), ("--curriculum", "0:16")])
@example([("--threads", "100000"), ("--lr", "nan")])
def test_random_train_flags_give_only_clean_errors(pairs):
    argv = []
    for flag, value in pairs:
        argv += [flag] if flag.startswith("--no-") or flag in ("--qat", "--plot", "--attn-res") else [flag, value]
    try:
        args = build_train_parser().parse_args(argv)
    except SystemExit as e:  # argparse's own usage error
        assert e.code == 2
        return
    try:
        train_config_from_args(args)
    except K3Error:
        pass
