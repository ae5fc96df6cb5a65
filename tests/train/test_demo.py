"""`k3 demo`'s own code path (whole-split evaluation, gzip comparison, samples, plot), run on the
nano preset cut to 2 layers and a small local corpus instead of the 2-layer tiny on the whole
stdlib; and the demo recipe's architecture (every K3 part on)."""

from __future__ import annotations

import json

import pytest
from test_loop import make_corpus  # same folder (pytest's default rootdir-relative import)

from k3.cli.infer import sample_main
from k3.infer.run_model import load_run_model
from k3.cli import train as commands
from k3.train.config import TrainConfig, resolve_model_config
from k3.checkpoint.rundir import MARKER_NAME

# nano cut to 2 layers the way the demo cuts tiny (model_overrides on the preset)
NANO_2_LAYERS = {"num_hidden_layers": 2, "attn_res_block_size": 1,
                 "linear_attn_config": {"kda_layers": [1], "full_attn_layers": [2], "num_heads": 2,
                                        "head_dim": 32}}


def test_demo_recipe_keeps_every_k3_part_on():
    """The demo's model: KDA + MLA with MLA at every 4th and the last layer (the presets' rule,
    written out here), >= 1 MLA layer, Block AttnRes, LatentMoE with a shared expert, SiTU; trained
    with Per-Head Muon and Quantile Balancing."""
    tc = TrainConfig.build(overrides={**commands.DEMO_CONFIG, "steps": commands.DEMO_STEPS})
    cfg = resolve_model_config(tc)
    n = cfg.num_hidden_layers
    full = [i for i in range(1, n + 1) if i % 4 == 0 or i == n]
    assert cfg.linear_attn_config.full_attn_layers == full and len(full) >= 1
    assert cfg.linear_attn_config.kda_layers == [i for i in range(1, n + 1) if i not in full]
    assert cfg.attn_res_block_size is not None and cfg.attn_res_block_size < n
    assert cfg.num_experts > cfg.num_experts_per_token >= 1 and cfg.num_shared_experts >= 1
    assert cfg.routed_expert_hidden_size is not None and cfg.routed_expert_hidden_size < cfg.hidden_size
    assert cfg.hidden_act == "situ"
    assert (tc.optimizer, tc.balance, tc.attn_res, tc.hidden_act) == ("per_head", "quantile", None, None)


@pytest.mark.slow
def test_demo_reports_whole_split_bpb_next_to_gzip_and_samples(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("K3_CACHE_DIR", str(tmp_path / "cache"))
    data = make_corpus(tmp_path / "data")
    monkeypatch.setattr(commands, "DEMO_CONFIG", {
        **commands.DEMO_CONFIG, "preset": "nano", "model_overrides": NANO_2_LAYERS, "data": str(data),
        "curriculum": [[0, 64]], "batch_size": 4, "eval_interval": 2, "eval_batches": 1, "final_eval_batches": 1,
        "ckpt_interval": 0})
    out = tmp_path / "demo"
    assert commands.demo_main(["--out", str(out), "--steps", "4", "--threads", "1", "--samples-tokens", "8"]) == 0
    text = capsys.readouterr().out
    assert "validation, whole split:" in text and "on the same text: gzip -9" in text and "xz -9e" in text
    assert text.count("--- sample") == len(commands.DEMO_PROMPTS)
    assert "nano preset at 2 layers (1 KDA + 1 MLA)" in text
    assert (out / "loss.png").is_file()
    # k3 sample reads the demo's model (its overrides included) from the run's checkpoint
    model, _ = load_run_model(out)
    assert model.config.num_hidden_layers == 2 and len(model.model.layers) == 2
    assert sample_main([str(out), "--prompt", "def ", "--max-new-tokens", "4", "--seed", "0"]) == 0
    assert capsys.readouterr().out.startswith("def ")
    assert json.loads((out / MARKER_NAME).read_text())["created_by"] == "k3 demo"
    # a second demo replaces its own folder but refuses to delete anything else
    assert commands.demo_main(["--out", str(out), "--steps", "1", "--threads", "1", "--samples-tokens", "2"]) == 0
    assert json.loads((out / MARKER_NAME).read_text())["created_by"] == "k3 demo"
    other = tmp_path / "precious"
    other.mkdir()
    (other / "thesis.tex").write_text("years of work")
    assert commands.demo_main(["--out", str(other), "--steps", "1"]) == 2
    assert "not a k3 run directory" in capsys.readouterr().err
    assert [p.name for p in other.iterdir()] == ["thesis.tex"]
