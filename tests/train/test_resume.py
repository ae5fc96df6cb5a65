"""Checkpoints: bit-exact resume, checkpoint at SIGTERM, a failed save never replaces a good one."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from test_loop import make_corpus  # same folder (pytest puts it on sys.path)

from k3.train.commands import train_main
from k3.train.config import TrainConfig
from k3.train.loop import Trainer
from k3.train.metrics import read_metrics
from k3.train.state import CKPT_NAME, CheckpointCorrupt, find_checkpoint, load_trainer_state, verify_checkpoint

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    base = tmp_path_factory.mktemp("resume")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("K3_CACHE_DIR", str(base / "cache"))
        yield base, make_corpus(base / "data")


def config(base: Path, data: Path, name: str, **kw) -> TrainConfig:
    # grad accumulation, a curriculum change after the stop, warmup and decay spanning it, QB on:
    # every piece of state a resume has to restore is exercised.
    opts = dict(preset="nano", data=str(data), out=str(base / name), steps=8, batch_size=2,
                grad_accum=2, curriculum=[[0, 16], [6, 32]], warmup_frac=0.25, decay_frac=0.5,
                lr=0.01, threads=1, eval_interval=3, eval_batches=1, final_eval_batches=1,
                ckpt_interval=0, log_interval=1, plot=False)
    opts.update(kw)
    return TrainConfig.build(overrides=opts)


def train_losses(run: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(run) if r["kind"] == "train"]


def test_resume_reproduces_the_uninterrupted_run_bit_exactly(env):
    base, data = env
    full = Trainer(config(base, data, "full"))
    assert full.train().status == "done"

    part = Trainer(config(base, data, "part"))

    def stop_at_4(tr, rec):  # what the SIGTERM handler does, at a chosen step
        if tr.step == 4:
            tr.stop_signal = signal.SIGTERM

    part.on_step_end.append(stop_at_4)
    assert part.train().status == "interrupted" and part.step == 4
    del part
    resumed = Trainer(config(base, data, "part"), resume=True)
    assert resumed.step == 4
    assert resumed.train().status == "done"

    a, b = train_losses(base / "full"), train_losses(base / "part")
    assert len(a) == 8 and a == b  # exact float equality, every step
    sa, sb = full.model.state_dict(), resumed.model.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    bias = [k for k in sa if k.endswith("e_score_correction_bias")]
    assert bias and any(sa[k].abs().sum() > 0 for k in bias)  # QB biases moved and were restored
    va = [r["val_loss"] for r in read_metrics(base / "full") if r["kind"] == "val"]
    vb = [r["val_loss"] for r in read_metrics(base / "part") if r["kind"] == "val"]
    assert va == vb and len(va) == 3  # steps 3, 6 and the final eval


def _wait_for(pred, timeout: float) -> bool:
    end = time.time() + timeout
    while time.time() < end:
        if pred():
            return True
        time.sleep(0.2)
    return False


@pytest.mark.slow
def test_sigterm_writes_a_checkpoint_and_resume_finishes(env):
    base, data = env
    run = base / "sig"
    args = ["--preset", "nano", "--data", str(data), "--out", str(run), "--steps", "400",
            "--batch-size", "2", "--seq-len", "16", "--threads", "1", "--eval-interval", "0",
            "--final-eval-batches", "1", "--no-plot"]
    code = "import sys; from k3.train.commands import train_main; sys.exit(train_main(sys.argv[1:]))"
    proc = subprocess.Popen([sys.executable, "-c", code, *args], cwd=REPO, env=os.environ.copy(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        metrics = run / "metrics.jsonl"
        started = _wait_for(lambda: metrics.is_file() and metrics.read_text().count('"train"') >= 2, 60)
        assert started, proc.stderr.read() if proc.poll() is not None else "no training step within 60 s"
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "SIGTERM" in out and "--resume" in out
    ckpt = find_checkpoint(run)
    step = load_trainer_state(ckpt)["step"]
    assert 2 <= step < 400
    assert len(train_losses(run)) == step
    assert train_main(["--resume", str(run), "--steps", str(step + 3)]) == 0
    assert load_trainer_state(find_checkpoint(run))["step"] == step + 3


def test_failed_save_keeps_the_previous_checkpoint(env, monkeypatch):
    base, data = env
    t = Trainer(config(base, data, "fail", steps=4, eval_interval=0))
    t.train_step()
    t.save()
    good = verify_checkpoint(base / "fail" / CKPT_NAME)
    assert good["step"] == 1
    t.train_step()
    real_save = torch.save

    def failing_save(obj, f, *a, **kw):
        if str(f).endswith("trainer_state.pt"):
            raise OSError("No space left on device")
        return real_save(obj, f, *a, **kw)

    monkeypatch.setattr(torch, "save", failing_save)
    with pytest.raises(OSError, match="No space left"):
        t.save()
    monkeypatch.setattr(torch, "save", real_save)
    run = base / "fail"
    assert verify_checkpoint(run / CKPT_NAME)["step"] == 1
    assert [p.name for p in run.iterdir() if p.name.startswith(".checkpoint")] == []
    del t
    assert Trainer(config(base, data, "fail", steps=4, eval_interval=0), resume=True).step == 1


def test_interrupted_commit_and_corrupt_files_are_detected(env):
    base, data = env
    t = Trainer(config(base, data, "crash", steps=4, eval_interval=0))
    t.train_step()
    t.save()
    t.train_step()
    t.save()
    run = base / "crash"
    ckpt = run / CKPT_NAME
    # a crash between the two renames of a commit: the complete previous checkpoint sits under .prev
    os.rename(ckpt, run / (CKPT_NAME + ".prev"))
    (ckpt).mkdir()
    (ckpt / "optimizer.pt").write_bytes(b"partial")
    assert find_checkpoint(run) == run / (CKPT_NAME + ".prev")
    t.train_step()
    t.save()  # recovers, then commits step 3
    assert find_checkpoint(run) == ckpt and verify_checkpoint(ckpt)["step"] == 3
    assert not (run / (CKPT_NAME + ".prev")).exists()
    # a damaged file is caught by the manifest
    shard = next((ckpt / "model").glob("*.safetensors"))
    data_bytes = bytearray(shard.read_bytes())
    data_bytes[-1] ^= 0xFF
    shard.write_bytes(bytes(data_bytes))
    with pytest.raises(CheckpointCorrupt, match="does not match the manifest"):
        verify_checkpoint(ckpt)
    assert find_checkpoint(run) is None
