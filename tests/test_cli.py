import json
import subprocess
import sys

import pytest

from k3.cli import main


def test_params_k3_prints_released_totals(capsys):
    assert main(["params", "--preset", "k3"]) == 0
    out = capsys.readouterr().out
    assert "2,779,484,476,000" in out and "104.19B" in out
    assert "routed_experts" in out and "GB" in out


def test_params_json_from_config_file(tmp_path, capsys):
    from k3.config import get_preset

    get_preset("kimi-linear-48b").to_json(tmp_path / "config.json")
    assert main(["params", "--config", str(tmp_path), "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["components"]["attn_res"] == 0 and d["total"] > 48e9


def test_params_bad_config_is_a_clear_error(tmp_path, capsys):
    (tmp_path / "config.json").write_text('{"hidden_size": -1}')
    assert main(["params", "--config", str(tmp_path / "config.json")]) == 2
    assert "hidden_size must be > 0" in capsys.readouterr().err


@pytest.mark.slow
def test_console_script_runs():
    r = subprocess.run([sys.executable, "-m", "k3.cli", "params", "--preset", "nano"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "total" in r.stdout


def test_params_mxfp4_states_bits_and_checkpoint_size(capsys):
    assert main(["params", "--preset", "k3", "--mxfp4"]) == 0
    out = capsys.readouterr().out
    assert "4.25 bits per parameter" in out
    assert "1,452.8 GiB" in out and "1,453.7 GiB in 96 shards" in out


def test_inspect_and_convert_are_wired(tmp_path, capsys):
    import torch

    from k3.checkpoint import save_pretrained
    from k3.config import get_preset
    from k3.model.decoder import K3ForCausalLM

    torch.manual_seed(0)
    save_pretrained(K3ForCausalLM(get_preset("nano")), tmp_path / "a")
    assert main(["convert", str(tmp_path / "a"), str(tmp_path / "b"), "--dtype", "bf16"]) == 0
    assert main(["inspect", str(tmp_path / "b")]) == 0
    out = capsys.readouterr().out
    assert "bfloat16" in out


def test_unknown_arguments_are_rejected(capsys):
    import pytest

    with pytest.raises(SystemExit):
        main(["params", "--preset", "k3", "--bogus"])
