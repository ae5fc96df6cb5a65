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
    assert d["components"]["attn_res"] == 0
    assert d["total"] == 49_122_681_728             # the exact kimi-linear-48b count


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
    import re

    from k3.config import get_preset
    from k3.model.summary import build_meta_model

    assert main(["params", "--preset", "k3", "--mxfp4"]) == 0
    out = capsys.readouterr().out
    assert "4.25 bits per parameter" in out and "in 96 shards" in out
    # Independent tally over the meta model's tensors (not the checkpoint name table the CLI
    # uses): routed experts 4 bits + one 8-bit scale per 32 = 4.25 bits; the release's fp32
    # tensors (short convs, A_log, dt_bias, KDA o_norm, router bias) 4 bytes; the rest bf16.
    fp32 = re.compile(r"(_conv1d\.weight|A_log|dt_bias|o_norm\.weight|e_score_correction_bias)$")
    model = build_meta_model(get_preset("k3"))
    nbytes = 0.0
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        nbytes += t.numel() * (4.25 / 8 if ".experts." in name else 4 if fp32.search(name) else 2)
    routed = 92 * 896 * 3 * 3584 * 3072           # 92 MoE layers x 896 experts x (w1, w3, w2)
    assert f"packed text checkpoint: {nbytes:,.0f} bytes = {nbytes / 2**30:,.1f} GiB" in out
    assert f"-> {routed * 4.25 / 8 / 2**30:,.1f} GiB" in out


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
