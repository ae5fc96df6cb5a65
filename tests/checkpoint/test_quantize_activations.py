"""Which activations a packed checkpoint declares and applies (SPEC §3.7): `k3 quantize` of a QAT
run declares MXFP8 `input_activations` and reproduces the QAT model in both load layouts; a plain
run is weights-only; contradictory requests and undeclarable schemes are refused."""
import json

import pytest
import torch
from checkpoint_models import random_model
from test_quantize import _experts, _logits, _one_thread, packed_ckpt  # noqa: F401 (fixtures)

from k3.checkpoint import CheckpointError, from_pretrained, save_pretrained
from k3.checkpoint.quantize import quantize
from k3.cli.checkpoint import quantize_main
from k3.train.qat import enable_qat


def _run_dir(tmp_path, qat, seed=11):
    """A k3 run directory as the trainer lays it out: run.json (train config) + checkpoint/model."""
    run = tmp_path / f"run-{qat}"
    model = random_model("nano", seed=seed)
    save_pretrained(model, run / "checkpoint" / "model")
    (run / "run.json").write_text(json.dumps({"train_config": {"qat": qat, "steps": 10}}))
    return run, model


def _declared_acts(d):
    return json.loads((d / "config.json").read_text())["quantization_config"]["config_groups"]["group_0"][
        "input_activations"]


@pytest.mark.parametrize("src_form", ["run", "checkpoint", "checkpoint/model"])
def test_quantize_of_a_qat_run_declares_mxfp8_and_reproduces_the_qat_model(tmp_path, src_form):
    run, model = _run_dir(tmp_path, qat=True)
    src = run if src_form == "run" else run / src_form
    quantize(src, tmp_path / "q", dtype=torch.float32)
    assert _declared_acts(tmp_path / "q")["num_bits"] == 8
    enable_qat(model)
    assert torch.equal(_logits(from_pretrained(tmp_path / "q")), _logits(model))
    assert torch.equal(_logits(from_pretrained(tmp_path / "q", keep_packed=False)), _logits(model))


def test_quantize_of_a_plain_run_is_weights_only(tmp_path):
    run, _ = _run_dir(tmp_path, qat=False)
    quantize(run, tmp_path / "q")
    assert _declared_acts(tmp_path / "q") is None


@pytest.mark.parametrize("qat, flag", [(True, "none"), (False, "mxfp8")])
def test_activations_flag_contradicting_the_run_is_refused(tmp_path, capsys, qat, flag):
    run, _ = _run_dir(tmp_path, qat=qat)
    agreeing = "mxfp8" if qat else "none"
    assert quantize_main([str(run), str(tmp_path / "ok"), "--activations", agreeing]) == 0  # positive control
    from k3.cli import main
    assert main(["quantize", str(run), str(tmp_path / "q"), "--activations", flag]) == 2
    err = capsys.readouterr().err
    assert f"--activations {flag} contradicts the run record" in err and "Traceback" not in err
    assert not (tmp_path / "q").exists()


def test_activations_flag_contradicting_a_packed_source_is_refused(tmp_path):
    save_pretrained(random_model("nano"), tmp_path / "src")
    quantize(tmp_path / "src", tmp_path / "q8", activations="mxfp8")
    quantize(tmp_path / "q8", tmp_path / "again")  # auto keeps the source's declaration
    assert _declared_acts(tmp_path / "again")["num_bits"] == 8
    with pytest.raises(CheckpointError, match="contradicts the source's quantization_config"):
        quantize(tmp_path / "q8", tmp_path / "bad", activations="none")


@pytest.mark.parametrize("acts, ok", [(None, True), ({"num_bits": 8, "type": "float", "strategy": "group",
                                                      "group_size": 32}, True),
                                      ({"num_bits": 8, "type": "int", "strategy": "token"}, False),
                                      ({"num_bits": 4, "type": "float", "strategy": "group", "group_size": 32}, False)])
def test_undeclarable_input_activations_are_refused_naming_the_field(packed_ckpt, acts, ok):
    cfg = json.loads((packed_ckpt / "config.json").read_text())
    cfg["quantization_config"]["config_groups"]["group_0"]["input_activations"] = acts
    (packed_ckpt / "config.json").write_text(json.dumps(cfg))
    if ok:
        model = from_pretrained(packed_ckpt)
        assert {m.act_fmt for m in _experts(model)} == {None if acts is None else "fp8_e4m3"}
    else:
        with pytest.raises(CheckpointError, match=r"config\.json: quantization_config\.config_groups\.group_0"
                                                  r"\.input_activations"):
            from_pretrained(packed_ckpt)


@pytest.mark.slow
def test_a_real_qat_run_quantizes_to_its_own_logits(tmp_path, monkeypatch):
    """End to end: `k3 train --qat` writes the run, `k3 quantize RUN` finds the QAT record by itself,
    and the packed model gives exactly the logits `k3 sample` computes from the run."""
    import shutil
    import sysconfig
    from pathlib import Path

    from k3.cli import main
    from k3.infer.run_model import load_run_model

    monkeypatch.setenv("K3_CACHE_DIR", str(tmp_path / "cache"))
    data = tmp_path / "data"
    data.mkdir()
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for name in ("textwrap.py", "csv.py", "fnmatch.py", "heapq.py"):
        shutil.copy(stdlib / name, data / name)
    run = tmp_path / "run"
    assert main(["train", "--preset", "nano", "--data", str(data), "--out", str(run), "--steps", "2",
                 "--batch-size", "2", "--seq-len", "32", "--threads", "1", "--qat", "--no-plot",
                 "--final-eval-batches", "1"]) == 0
    assert main(["quantize", str(run), str(tmp_path / "q"), "--dtype", "fp32"]) == 0
    assert _declared_acts(tmp_path / "q")["type"] == "float"
    qat_model, _ = load_run_model(run)
    for keep_packed in (True, False):
        assert torch.equal(_logits(from_pretrained(tmp_path / "q", keep_packed=keep_packed)), _logits(qat_model))


def test_load_checkpoint_refuses_a_model_whose_experts_run_other_activations(tmp_path):
    from k3.checkpoint import load_checkpoint
    save_pretrained(random_model("nano"), tmp_path / "src")
    quantize(tmp_path / "src", tmp_path / "q8", activations="mxfp8")
    quantize(tmp_path / "src", tmp_path / "q4")
    weights_only = from_pretrained(tmp_path / "q4")
    assert load_checkpoint(weights_only, tmp_path / "q4") == []  # positive control: same declaration
    with pytest.raises(CheckpointError, match="declares input_activations fp8_e4m3 but the model's experts run"):
        load_checkpoint(weights_only, tmp_path / "q8")
    assert load_checkpoint(from_pretrained(tmp_path / "q8"), tmp_path / "q8") == []
