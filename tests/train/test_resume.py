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

from k3.cli.train import train_main
from k3.train.config import TrainConfig
from k3.train.loop import Trainer
from k3.train.metrics import read_metrics
from k3.errors import CheckpointError
from k3.checkpoint.training import CKPT_NAME, CheckpointCorrupt, find_checkpoint, load_trainer_state, verify_checkpoint

REPO = Path(__file__).resolve().parents[2]


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
    code = "import sys; from k3.cli.train import train_main; sys.exit(train_main(sys.argv[1:]))"
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
    with pytest.raises(CheckpointError, match="step 2 not saved: No space left.*previous checkpoint is intact"):
        t.save()
    monkeypatch.setattr(torch, "save", real_save)
    run = base / "fail"
    assert verify_checkpoint(run / CKPT_NAME)["step"] == 1
    assert [p.name for p in run.iterdir() if p.name.startswith(".checkpoint")] == []
    assert len([p for p in run.iterdir() if p.name.startswith(CKPT_NAME + "-")]) == 1
    t.close()
    del t
    assert Trainer(config(base, data, "fail", steps=4, eval_interval=0), resume=True).step == 1


def test_interrupted_saves_leave_the_pointer_on_a_complete_checkpoint(env):
    base, data = env
    t = Trainer(config(base, data, "crash", steps=4, eval_interval=0))
    t.train_step()
    first = t.save()
    run = base / "crash"
    ckpt = run / CKPT_NAME
    assert ckpt.is_symlink() and find_checkpoint(run) == first
    # the states a kill -9 can leave: a half-written temp folder, a renamed version that never
    # became current, a temporary link that never replaced the pointer
    (run / ".checkpoint-tmp-dead").mkdir()
    (run / ".checkpoint-tmp-dead" / "optimizer.pt").write_bytes(b"partial")
    orphan = run / (CKPT_NAME + "-00000009-dead")
    orphan.mkdir()
    os.symlink(orphan.name, run / ".checkpoint-link-dead")
    assert find_checkpoint(run) == first and verify_checkpoint(ckpt)["step"] == 1
    t.train_step()
    second = t.save()  # cleans the leftovers, commits step 2, keeps step 1 for in-flight readers
    assert find_checkpoint(run) == second and verify_checkpoint(ckpt)["step"] == 2
    assert sorted(p.name for p in run.iterdir() if "checkpoint" in p.name) == sorted(
        [CKPT_NAME, first.name, second.name])
    t.train_step()
    third = t.save()
    assert not first.exists() and second.is_dir() and find_checkpoint(run) == third
    t.close()


def test_legacy_layout_is_adopted_without_loss(env):
    base, data = env
    t = Trainer(config(base, data, "legacy", steps=4, eval_interval=0))
    t.train_step()
    v = t.save()
    run = base / "legacy"
    # the layout of older k3 versions: real folders checkpoint (incomplete) + checkpoint.prev
    (run / CKPT_NAME).unlink()
    os.rename(v, run / (CKPT_NAME + ".prev"))
    (run / CKPT_NAME).mkdir()
    (run / CKPT_NAME / "optimizer.pt").write_bytes(b"partial")
    assert find_checkpoint(run) == run / (CKPT_NAME + ".prev")
    t.train_step()
    t.save()
    assert verify_checkpoint(run / CKPT_NAME)["step"] == 2 and not (run / (CKPT_NAME + ".prev")).exists()
    t.close()


def test_corrupt_checkpoint_is_reported_never_absent_and_never_deleted(env, capsys):
    base, data = env
    run = base / "corrupt"
    t = Trainer(config(base, data, "corrupt", steps=4, eval_interval=0))
    t.train_step()
    t.save()
    t.close()
    ckpt = find_checkpoint(run)
    shard = next((ckpt / "model").glob("*.safetensors"))
    good = shard.read_bytes()
    data_bytes = bytearray(good)
    data_bytes[-1] ^= 0xFF
    shard.write_bytes(bytes(data_bytes))
    with pytest.raises(CheckpointCorrupt, match="does not match the manifest"):
        verify_checkpoint(ckpt)
    with pytest.raises(CheckpointCorrupt, match=r"model/.*safetensors does not match"):
        find_checkpoint(run)
    common = ["--data", str(data), "--preset", "nano", "--steps", "2", "--batch-size", "2",
              "--seq-len", "16", "--threads", "1", "--no-plot", "--final-eval-batches", "1"]
    assert train_main(["--resume", str(run)]) == 2
    assert "safetensors does not match the manifest" in capsys.readouterr().err
    from k3.cli.infer import sample_main
    assert sample_main([str(run), "--max-new-tokens", "2"]) == 2
    assert "safetensors does not match the manifest" in capsys.readouterr().err
    assert train_main(common + ["--out", str(run)]) == 2  # a fresh run refuses, deletes nothing
    err = capsys.readouterr().err
    assert "fails verification" in err and "--overwrite" in err
    assert shard.read_bytes() == bytes(data_bytes)
    # positive controls: the repaired checkpoint resumes; --overwrite replaces it explicitly
    shard.write_bytes(good)
    assert train_main(["--resume", str(run), "--steps", "2"]) == 0
    assert train_main(common + ["--out", str(run), "--overwrite"]) == 0
    assert load_trainer_state(find_checkpoint(run))["step"] == 2 and not shard.exists()


def test_a_pinned_checkpoint_outlives_later_saves(env):
    from k3.checkpoint.training import pinned_checkpoint

    base, data = env
    t = Trainer(config(base, data, "pin", steps=8, eval_interval=0))
    run = base / "pin"
    t.train_step()
    t.save()
    with pinned_checkpoint(run) as pinned:
        for _ in range(3):
            t.train_step()
            t.save()
        assert pinned.is_dir() and verify_checkpoint(pinned)["step"] == 1  # still whole
    t.train_step()
    t.save()
    # positive control: unpinned, it is rotated out like any other old version
    assert not pinned.exists()
    assert len([p for p in run.iterdir() if p.name.startswith(CKPT_NAME + "-")]) == 2
    t.close()
