"""The training loop end to end on the nano preset: learning, NaN skipping, bad input, the CLI."""

from __future__ import annotations

import json
import shutil
import sysconfig
from pathlib import Path

import pytest
import torch

from k3.cli.infer import sample_main
from k3.cli.train import train_main
from k3.train.config import TrainConfig
from k3.train.loop import Trainer, TrainingDiverged
from k3.train.metrics import read_metrics
from k3.checkpoint.training import find_checkpoint, load_trainer_state

STDLIB = Path(sysconfig.get_paths()["stdlib"])


def make_corpus(root: Path) -> Path:
    """~100 KB of real Python: a few stdlib modules copied into ``root``."""
    root.mkdir(parents=True, exist_ok=True)
    for name in ("json/__init__.py", "json/decoder.py", "json/encoder.py", "json/scanner.py",
                 "textwrap.py", "csv.py", "bisect.py", "heapq.py", "colorsys.py", "fnmatch.py"):
        shutil.copy(STDLIB / name, root / name.replace("/", "_"))
    return root


def nano(base: Path, data: Path, name: str, **kw) -> TrainConfig:
    opts = dict(preset="nano", data=str(data), out=str(base / name), steps=6, batch_size=4,
                curriculum=[[0, 32]], threads=1, eval_interval=0, eval_batches=2,
                final_eval_batches=2, ckpt_interval=0, log_interval=1, plot=False)
    opts.update(kw)
    return TrainConfig.build(overrides=opts)


@pytest.mark.slow
def test_nano_learns_and_writes_run_dir(env, capsys):
    base, data = env
    out = base / "learn"
    rc = train_main(["--preset", "nano", "--data", str(data), "--out", str(out), "--steps", "40",
                     "--batch-size", "8", "--seq-len", "64", "--lr", "0.01", "--threads", "1",
                     "--eval-interval", "20", "--eval-batches", "2", "--final-eval-batches", "4",
                     "--ckpt-interval", "20", "--log-interval", "10"])
    assert rc == 0
    recs = read_metrics(out)
    losses = [r["loss"] for r in recs if r["kind"] == "train"]
    assert len(losses) == 40
    assert sum(losses[-5:]) / 5 < losses[0] - 1.0, losses
    vals = [r for r in recs if r["kind"] == "val"]
    assert [v["step"] for v in vals] == [20, 40]
    assert vals[-1]["val_loss"] < vals[0]["val_loss"]
    # bits per byte = nats · tokens / bytes / ln 2
    v = vals[-1]
    assert v["val_bpb"] == pytest.approx(v["val_loss"] * v["val_tokens"] / v["val_bytes"] / 0.6931471805599453)
    tr = [r for r in recs if r["kind"] == "train"][-1]
    assert tr["seq_len"] == 64 and tr["tokens_per_s"] > 0 and len(tr["load_cv_layers"]) == 3
    info = json.loads((out / "run.json").read_text())
    assert info["train_config"]["lr"] == 0.01 and info["model_config"]["hidden_size"] == 64
    assert "git_commit" in info and info["k3_version"]
    assert (out / "loss.png").stat().st_size > 1000
    ckpt = find_checkpoint(out)
    assert load_trainer_state(ckpt)["step"] == 40
    assert "val bpb" in capsys.readouterr().err
    # k3 sample on the trained run: prompt + continuation through the cache
    assert sample_main([str(out), "--prompt", "def ", "--max-new-tokens", "12", "--seed", "1"]) == 0
    assert capsys.readouterr().out.startswith("def ")


def test_toml_config_and_flags_override(env, tmp_path):
    base, data = env
    toml = tmp_path / "run.toml"
    toml.write_text(f'preset = "nano"\ndata = "{data}"\nsteps = 3\nbatch_size = 2\nlr = 0.005\n'
                    f'curriculum = [[0, 16], [2, 32]]\nthreads = 1\nplot = false\n'
                    f'eval_interval = 0\nfinal_eval_batches = 1\n[model_overrides]\nnum_experts = 4\n')
    out = tmp_path / "run"
    assert train_main(["--config", str(toml), "--out", str(out), "--lr", "0.002", "--no-attn-res"]) == 0
    info = json.loads((out / "run.json").read_text())
    assert info["train_config"]["lr"] == 0.002 and info["train_config"]["steps"] == 3
    assert info["model_config"]["num_experts"] == 4
    assert info["model_config"]["attn_res_block_size"] is None
    assert [r["seq_len"] for r in read_metrics(out) if r["kind"] == "train"] == [16, 16, 32]
    toml.write_text("stepz = 3\n")
    assert train_main(["--config", str(toml), "--out", str(tmp_path / "x")]) == 2


def _params(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_non_finite_loss_and_grad_steps_are_skipped_and_logged(env):
    base, data = env
    t = Trainer(nano(base, data, "skip", steps=5))
    snaps = {}
    handles = []

    def start(tr, step):
        for h in handles:
            h.remove()
        handles.clear()
        snaps[step] = _params(tr.model)
        if step == 1:  # NaN logits -> NaN loss
            handles.append(tr.model.lm_head.register_forward_hook(lambda m, i, o: o * float("nan")))
        if step == 3:  # finite loss, Inf gradient
            w = tr.model.model.embed_tokens.weight
            handles.append(w.register_hook(lambda g: g * float("inf")))

    t.on_step_start.append(start)
    res = t.train()
    assert res.status == "done" and t.step == 5
    recs = [r for r in t.metrics.records if r["kind"] in ("train", "skip")]
    assert [r["kind"] for r in recs] == ["train", "skip", "train", "skip", "train"]
    assert "non-finite loss" in recs[1]["reason"] and "gradient norm" in recs[3]["reason"]
    # a skipped step leaves every weight (and router bias) as it was
    for s in (1, 3):
        after = snaps[s + 1]
        assert all(torch.equal(snaps[s][k], after[k]) for k in after)
    assert not torch.equal(snaps[0]["lm_head.weight"], snaps[1]["lm_head.weight"])
    assert res.losses[1] is None and res.losses[3] is None


def test_a_step_with_zero_gradient_moves_no_weight(env):
    """An RL step whose groups are all degenerate has advantage 0 everywhere, so every gradient is
    exactly 0. Muon (and Adam) would still move the weights along the momentum of earlier steps: the
    optimizer is not stepped then, and the record says so. Here step 2's logits are multiplied by 0
    (gradient 0, finite loss) after two ordinary steps; the control is step 3, ordinary again."""
    base, data = env
    t = Trainer(nano(base, data, "zero", steps=6))
    snaps, handles = {}, []

    def start(tr, step):
        for h in handles:
            h.remove()
        handles.clear()
        snaps[step] = {k: v.detach().clone() for k, v in tr.model.named_parameters()}
        if step == 2:
            handles.append(tr.model.lm_head.register_forward_hook(lambda m, i, o: o * 0.0))

    t.on_step_start.append(start)
    assert t.train().status == "done"
    recs = [r for r in t.metrics.records if r["kind"] == "train"]
    assert [r.get("no_update") for r in recs] == [None, None, "zero gradient", None, None, None]
    assert recs[2]["grad_norm"] == 0.0 and recs[3]["lr"] > 0
    assert all(torch.equal(snaps[2][k], snaps[3][k]) for k in snaps[2])
    assert not torch.equal(snaps[3]["lm_head.weight"], snaps[4]["lm_head.weight"])   # the control


def test_training_stops_after_max_consecutive_skips(env, capsys):
    base, data = env
    t = Trainer(nano(base, data, "diverge", steps=20, max_skips=3))

    def poison(tr, step):
        if step == 2:
            with torch.no_grad():
                tr.model.model.norm.weight.fill_(float("nan"))

    t.on_step_start.append(poison)
    with pytest.raises(TrainingDiverged, match=r"3 consecutive steps skipped") as ex:
        t.train()
    assert t.step == 5
    assert "No checkpoint was written" in str(ex.value) and find_checkpoint(base / "diverge") is None
    # with a checkpoint on disk the message names its step, and that checkpoint is really there
    t2 = Trainer(nano(base, data, "diverge-ck", steps=20, max_skips=3, ckpt_interval=1))
    t2.on_step_start.append(poison)
    with pytest.raises(TrainingDiverged, match=r"The last checkpoint \(step 4\) is in"):
        t2.train()
    assert load_trainer_state(find_checkpoint(base / "diverge-ck"))["step"] == 4
    # through the CLI: a clear message and exit status 1
    rc = train_main(["--preset", "nano", "--data", str(data), "--out", str(base / "diverge2"),
                     "--steps", "10", "--batch-size", "2", "--seq-len", "16", "--threads", "1",
                     "--max-skips", "2", "--no-plot"],
                    trainer_hook=lambda tr: tr.on_step_start.append(poison))
    assert rc == 1
    assert "consecutive steps skipped" in capsys.readouterr().err


def test_bad_input_gives_clear_errors(env, tmp_path, capsys):
    base, data = env
    common = ["--preset", "nano", "--steps", "2", "--batch-size", "2", "--threads", "1", "--no-plot"]

    def err(argv) -> str:
        assert train_main(common + argv) == 2
        return capsys.readouterr().err

    assert "corpus path not found" in err(["--data", str(tmp_path / "missing"), "--out", str(tmp_path / "a")])
    empty = tmp_path / "empty"
    empty.mkdir()
    assert "empty" in err(["--data", str(empty), "--out", str(tmp_path / "b")])
    assert "max_position_embeddings=2048" in err(["--data", str(data), "--seq-len", "4096",
                                                  "--out", str(tmp_path / "c")])
    assert "fraction" in err(["--data", str(data), "--curriculum", "0:16,1.5:32", "--out", str(tmp_path / "d")])
    assert "holds no checkpoint" in err(["--resume", str(tmp_path / "nothing")])
    # a finished run: training again into it needs --resume; resuming with another model is refused
    run = tmp_path / "run"
    assert train_main(common + ["--data", str(data), "--seq-len", "16", "--out", str(run),
                                "--final-eval-batches", "1"]) == 0
    assert "--resume" in err(["--data", str(data), "--seq-len", "16", "--out", str(run)])
    msg = err(["--resume", str(run), "--preset", "tiny"])
    assert "different model config" in msg and "hidden_size" in msg
    assert "different model config" in err(["--resume", str(run), "--no-attn-res"])
    other = shutil.copytree(data, tmp_path / "other")
    (other / "extra.py").write_text("x = 1\n" * 50)
    assert "corpus" in err(["--resume", str(run), "--data", str(other)])


def test_qat_flag_trains_through_fake_quantized_experts_and_samples(env, capsys):
    from k3.train.qat import FakeQuantMXExperts

    base, data = env
    out = base / "qat"
    seen = []
    rc = train_main(["--preset", "nano", "--data", str(data), "--out", str(out), "--steps", "2",
                     "--batch-size", "2", "--seq-len", "32", "--threads", "1", "--qat", "--no-plot",
                     "--final-eval-batches", "1"],
                    trainer_hook=lambda tr: seen.extend(type(m.experts) for m in tr.model.moe_layers()))
    assert rc == 0 and seen and all(t is FakeQuantMXExperts for t in seen)
    capsys.readouterr()
    assert sample_main([str(out), "--prompt", "x = ", "--max-new-tokens", "4", "--seed", "0"]) == 0
    assert capsys.readouterr().out.startswith("x = ")


def test_ns_dtype_flag_sets_the_newton_schulz_precision(env, capsys):
    # --ns-dtype bf16 (the default) | fp32: the first loss precedes any update, so it is the same;
    # the third follows two updates orthogonalized at different precision, so it differs.
    base, data = env
    runs = {}
    for name, extra in (("default", []), ("fp32", ["--ns-dtype", "fp32"]), ("bf16", ["--ns-dtype", "bf16"])):
        got = []
        rc = train_main(["--preset", "nano", "--data", str(data), "--out", str(base / f"ns_{name}"), "--steps", "3",
                         "--batch-size", "2", "--seq-len", "32", "--threads", "1", "--no-plot",
                         "--final-eval-batches", "1", "--log-interval", "1", *extra], trainer_hook=got.append)
        assert rc == 0
        runs[name] = (got[0].optimizer.ns_dtype, [r["loss"] for r in got[0].metrics.records if r["kind"] == "train"])
    assert runs["default"][0] == runs["bf16"][0] == torch.bfloat16 and runs["fp32"][0] == torch.float32
    assert runs["default"][1] == runs["bf16"][1]
    assert runs["fp32"][1][0] == runs["bf16"][1][0] and runs["fp32"][1][2] != runs["bf16"][1][2]
    capsys.readouterr()
    assert train_main(["--preset", "nano", "--data", str(data), "--out", str(base / "ns_bad"),
                       "--ns-dtype", "fp16"]) == 2
    err = capsys.readouterr().err
    assert "ns_dtype" in err and len(err.strip().splitlines()) == 1


# --------------------------------------------------- one Trainer, an in-memory batch source
def _lcg_run(out: Path, **kw) -> TrainConfig:
    opts = dict(preset="nano", out=str(out), steps=4, batch_size=2, curriculum=[[0, 16]], threads=1,
                eval_interval=0, ckpt_interval=0, plot=False, lr=0.01)
    opts.update(kw)
    return TrainConfig.build(overrides=opts)


def test_in_memory_batches_train_and_resume_bit_exactly(tmp_path):
    """``Trainer(tc, batches=...)`` trains on the source (no corpus, tokenizer or validation) in one
    process (no subclass: a parallelism object); stopped after 2 steps and resumed, it continues the
    uninterrupted run's losses exactly. A source of other data (its fingerprint) is refused on resume."""
    from test_golden import LCGBatches

    from k3.errors import CheckpointError, ConfigError
    from k3.train.distributed import Distributed
    from k3.train.parallel import SingleProcess

    assert Trainer.__subclasses__() == [] and not issubclass(Distributed, Trainer)  # one Trainer
    vocab = 512
    whole = Trainer(_lcg_run(tmp_path / "whole"), print_fn=lambda *a: None, tty=False,
                    batches=LCGBatches(4, 2, 16, vocab))
    assert isinstance(whole.parallel, SingleProcess) and whole.tokenizer is None
    res = whole.train()
    assert res.status == "done" and res.val is None and len(res.losses) == 4 and None not in res.losses
    part = Trainer(_lcg_run(tmp_path / "part"), print_fn=lambda *a: None, tty=False,
                   batches=LCGBatches(4, 2, 16, vocab))
    first = [part.train_step()["loss"] for _ in range(2)]
    part.save()
    part.close()
    assert first == res.losses[:2]
    resumed = Trainer(_lcg_run(tmp_path / "part"), resume=True, print_fn=lambda *a: None, tty=False,
                      batches=LCGBatches(4, 2, 16, vocab))
    assert resumed.step == 2
    assert resumed.train().losses == res.losses[2:]
    other = LCGBatches(4, 2, 16, vocab)
    other.fingerprint = "another stream"
    with pytest.raises(CheckpointError, match="fingerprint 'another stream'"):
        Trainer(_lcg_run(tmp_path / "part"), resume=True, print_fn=lambda *a: None, tty=False, batches=other)
    with pytest.raises(ConfigError, match="batches: list has no next_batch"):
        Trainer(_lcg_run(tmp_path / "bad"), batches=[])
