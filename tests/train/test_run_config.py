"""TrainConfig / run.toml validation: every bad option is a ConfigError naming it, before any work."""
import math
import os

import pytest
import torch

from k3.errors import ConfigError
from k3.cli.train import train_main
from k3.train.config import (SEED_MAX, TrainConfig, load_toml, parse_curriculum, resolve_model_config)


def _toml(tmp_path, text: str):
    p = tmp_path / "run.toml"
    p.write_text(text)
    return str(p)


def build(tmp_path, text: str) -> TrainConfig:
    return TrainConfig.build(_toml(tmp_path, 'preset = "nano"\n' + text))


def test_misspelled_toml_key_is_refused_with_a_suggestion(tmp_path):
    with pytest.raises(ConfigError, match=r"run.toml: unknown option\(s\) 'stepz' \(did you mean 'steps'\?\)"):
        build(tmp_path, "stepz = 3\n")
    with pytest.raises(ConfigError, match="'learning_rate'"):
        load_toml(_toml(tmp_path, "learning_rate = 0.1\n"))
    assert build(tmp_path, "steps = 3\n").steps == 3


def test_unknown_keys_elsewhere_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="'bach_size' \\(did you mean 'batch_size'\\?\\)"):
        TrainConfig.from_dict({"bach_size": 2})
    with pytest.raises(ConfigError, match="model_overrides: unknown option\\(s\\) 'hiden_size'"):
        build(tmp_path, "[model_overrides]\nhiden_size = 32\n")
    with pytest.raises(ConfigError, match="'lrr'"):
        TrainConfig().replace(lrr=1.0)
    assert TrainConfig().replace(lr=1.0).lr == 1.0
    assert build(tmp_path, "[model_overrides]\nhidden_size = 32\n").model_overrides == {"hidden_size": 32}


@pytest.mark.parametrize("line, field", [
    ('qat = "no"', "qat"), ('qat = "false"', "qat"), ("qat = 0", "qat"), ('plot = "yes"', "plot"),
    ('attn_res = "true"', "attn_res"),
])
def test_strings_and_ints_are_not_booleans(tmp_path, line, field):
    with pytest.raises(ConfigError, match=f"{field} must be true or false"):
        build(tmp_path, line + "\n")
    assert getattr(build(tmp_path, f"{field} = false\n"), field) is False


@pytest.mark.parametrize("line, field", [
    ("lr = nan", "lr"), ("lr = inf", "lr"), ("lr = -inf", "lr"), ("weight_decay = nan", "weight_decay"),
    ("grad_clip = inf", "grad_clip"), ("balance_rate = nan", "balance_rate"),
    ("warmup_frac = nan", "warmup_frac"), ("decay_frac = nan", "decay_frac"),
    ("min_lr_ratio = nan", "min_lr_ratio"), ("curriculum = [[0, 16], [nan, 32]]", "curriculum start"),
])
def test_non_finite_floats_are_refused(tmp_path, line, field):
    key = line.split(" = ")[0]
    value = load_toml(_toml(tmp_path, line + "\n"))[key]  # TOML itself parses it: nan / inf
    assert not math.isfinite(value[1][0] if key == "curriculum" else value)
    with pytest.raises(ConfigError, match=f"{field}.* must be finite"):
        build(tmp_path, line + "\n")


def test_finite_floats_are_accepted(tmp_path):
    tc = build(tmp_path, "lr = 0.01\nweight_decay = 0.1\ncurriculum = [[0, 16], [0.5, 32]]\n")
    assert tc.lr == 0.01 and tc.context_curriculum().seq_len_at(tc.steps - 1) == 32


def test_threads_are_bounded_by_the_cpu_count(tmp_path):
    n = os.cpu_count()
    assert build(tmp_path, f"threads = {n}\n").threads == n
    with pytest.raises(ConfigError, match=f"threads must be <= {n}"):
        build(tmp_path, "threads = 100000\n")
    with pytest.raises(ConfigError, match="threads must be >= 0"):
        build(tmp_path, "threads = -1\n")


def test_seed_must_fit_torch_manual_seed(tmp_path):
    torch.manual_seed(SEED_MAX)  # the largest seed torch takes
    assert build(tmp_path, f"seed = {SEED_MAX}\n").seed == SEED_MAX
    with pytest.raises((RuntimeError, ValueError)):  # one past it overflows torch's uint64
        torch.manual_seed(SEED_MAX + 1)
    for bad in ("seed = 18446744073709551616", "seed = -1", "seed = 1e20"):
        with pytest.raises(ConfigError, match="seed must be"):
            TrainConfig.from_dict(load_toml(_toml(tmp_path, bad + "\n"))).validate()


def test_device_must_exist(tmp_path):
    assert TrainConfig(device="cpu").device == "cpu"
    TrainConfig(device="cpu").validate()
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for bad, message in ((f"cuda:{n}", "device='cuda:"), ("tpu", "not a torch device"),
                         ("meta", "cpu, cuda or mps"), (3, "device must be a string")):
        with pytest.raises(ConfigError, match=message):
            TrainConfig(device=bad).validate()
    if n == 0:
        with pytest.raises(ConfigError, match="device='cuda'.*no CUDA device"):
            TrainConfig(device="cuda").validate()
    else:
        TrainConfig(device="cuda").validate()


@pytest.mark.parametrize("argv, message", [
    (["--threads", "100000"], "threads must be <="),
    (["--device", "tpu"], "device='tpu'"),
    (["--lr", "nan"], "lr must be finite"),
    (["--preset", "nanoo"], "preset must be one of"),
])
def test_cli_flags_get_the_same_checks(tmp_path, capsys, argv, message):
    out = tmp_path / "run"
    assert train_main(["--preset", "nano", "--steps", "1", "--out", str(out)] + argv) == 2
    assert message in capsys.readouterr().err
    assert not out.exists()  # refused before anything was written


def test_cli_seed_that_is_not_an_int_is_an_argparse_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        train_main(["--preset", "nano", "--seed", "1e20", "--out", str(tmp_path / "r")])
    assert e.value.code == 2 and "--seed" in capsys.readouterr().err


@pytest.mark.parametrize("options, message", [
    ({"preset": ["nano"]}, "preset must be a non-empty string"),
    ({"curriculum": "0:16"}, "curriculum must be a non-empty list"),
    ({"curriculum": [[0, "16"]]}, "curriculum seq_len must be an int"),
    ({"curriculum": [[0, 16], [1.5, 32]]}, "fraction of the run"),
    ({"model_overrides": [1]}, "model_overrides must be a table"),
    ({"data": 3}, "data must be a path string"),
    ({"optimizer": "sgd"}, "optimizer must be one of"),
    ({"val_percent": 100}, "val_percent must be <= 99"),
    ({"steps": 2**40}, "steps must be <="),
])
def test_wrong_types_are_config_errors(options, message):
    with pytest.raises(ConfigError, match=message):
        TrainConfig.build(overrides={"preset": "nano", **options})
    TrainConfig.build(overrides={"preset": "nano"})  # positive control


def test_curriculum_text_and_model_resolution_errors():
    assert parse_curriculum("0:16,0.5:32") == [[0, 16], [0.5, 32]]
    with pytest.raises(ConfigError, match="START:SEQ_LEN"):
        parse_curriculum("0-16")
    tc = TrainConfig.build(overrides={"preset": "nano", "curriculum": [[0, 16]]})
    assert resolve_model_config(tc).hidden_size == 64
    with pytest.raises(ConfigError, match="attn_res=true needs attn_res_block_size"):
        resolve_model_config(tc.replace(attn_res=True, model_overrides={"attn_res_block_size": None}))
    with pytest.raises(ConfigError, match="rms_norm_eps must be finite"):
        resolve_model_config(tc.replace(model_overrides={"rms_norm_eps": float("nan")}))
    with pytest.raises(ConfigError, match="exceeds the model's max_position_embeddings"):
        resolve_model_config(tc.replace(curriculum=[[0, 4096]]))
