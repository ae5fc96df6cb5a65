"""Stopping: SIGTERM/SIGINT take effect within one micro-batch, a second Ctrl-C exits without a
traceback, and the checkpoint written at a stop resumes bit-exactly."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from k3.train.config import TrainConfig
from k3.train.loop import Trainer
from k3.train.metrics import read_metrics
from k3.checkpoint.training import find_checkpoint, load_trainer_state, verify_checkpoint

REPO = Path(__file__).resolve().parents[2]
TRAIN = "import sys; from k3.cli import main; sys.exit(main(['train', *sys.argv[1:]]))"


def config(base: Path, data: Path, name: str, **kw) -> TrainConfig:
    opts = dict(preset="nano", data=str(data), out=str(base / name), steps=5, batch_size=2,
                grad_accum=4, curriculum=[[0, 16]], lr=0.01, threads=1, eval_interval=0,
                final_eval_batches=1, ckpt_interval=0, log_interval=1, plot=False)
    opts.update(kw)
    return TrainConfig.build(overrides=opts)


def losses(run: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(run) if r["kind"] == "train"]


def test_stop_between_micro_batches_drops_the_step_and_resumes_bit_exactly(env):
    base, data = env
    full = Trainer(config(base, data, "full"))
    full.train()
    part = Trainer(config(base, data, "part"))
    real_loss = part._loss
    calls = []

    def loss(*args, **kwargs):  # the signal arrives during micro-batch 2 of step 3
        calls.append(part.step)
        if part.step == 2 and calls.count(2) == 2:
            part.stop_signal = signal.SIGTERM
        return real_loss(*args, **kwargs)

    part._loss = loss
    res = part.train()
    assert res.status == "interrupted" and part.step == 2
    assert calls.count(2) == 2  # micro-batches 3 and 4 of that step never ran
    assert load_trainer_state(find_checkpoint(base / "part"))["step"] == 2
    resumed = Trainer(config(base, data, "part"), resume=True)
    assert resumed.train().status == "done"
    assert losses(base / "part") == losses(base / "full")


def test_stop_during_the_final_evaluation_takes_effect_within_one_batch(env):
    base, data = env
    t = Trainer(config(base, data, "evalstop", steps=2, final_eval_batches=0))
    real_loss, eval_batches = t._loss, []

    def loss(x, y, reduction="mean"):
        if not t.model.training:  # an evaluation batch: the signal arrives during the first one
            eval_batches.append(1)
            t.stop_signal = signal.SIGTERM
        return real_loss(x, y, reduction)

    t._loss = loss
    res = t.train()
    assert res.status == "interrupted" and res.val is None and t.step == 2
    assert len(eval_batches) == 1  # the whole split would be many batches
    assert [r for r in read_metrics(base / "evalstop") if r["kind"] == "val"] == []
    assert load_trainer_state(find_checkpoint(base / "evalstop"))["step"] == 2


def _start(argv: list[str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", TRAIN, *argv], cwd=REPO, env=os.environ.copy(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _args(data: Path, run: Path, *extra: str) -> list[str]:
    return ["--preset", "nano", "--data", str(data), "--out", str(run), "--batch-size", "2",
            "--seq-len", "16", "--threads", "1", "--eval-interval", "0", "--final-eval-batches", "1",
            "--no-plot", *extra]


@pytest.mark.slow
def test_sigterm_with_long_grad_accum_exits_within_a_micro_batch(env):
    base, data = env
    run = base / "accum"
    # one optimizer step is 100000 micro-batches (~an hour): only a per-micro-batch check can stop it
    proc = _start(_args(data, run, "--steps", "2", "--grad-accum", "100000"))
    try:
        line = proc.stdout.readline()  # "corpus ..." then "model: ...; run dir": training starts next
        line += proc.stdout.readline()
        assert "run dir" in line, proc.stderr.read()
        time.sleep(2.0)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
        elapsed = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert elapsed < 15, elapsed  # one micro-batch (~10 ms) + writing the nano checkpoint
    print(f"SIGTERM to exit: {elapsed:.2f} s")
    assert "Traceback" not in err
    assert verify_checkpoint(run / "checkpoint")["step"] == 0 and losses(run) == []


@pytest.mark.slow
def test_second_ctrl_c_exits_cleanly_and_the_last_checkpoint_survives(env):
    base, data = env
    run = base / "twice"
    first = subprocess.run([sys.executable, "-c", TRAIN, *_args(data, run, "--steps", "1")], cwd=REPO,
                           env=os.environ.copy(), capture_output=True, text=True, timeout=120)
    assert first.returncode == 0, first.stderr
    proc = _start(["--resume", str(run), "--steps", "3", "--grad-accum", "100000"])
    try:
        assert "resuming at step 1" in proc.stdout.readline() + proc.stdout.readline()
        time.sleep(2.0)
        proc.send_signal(signal.SIGINT)
        time.sleep(0.05)
        proc.send_signal(signal.SIGINT)  # lands during the stop's checkpoint save, or after it
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGINT, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
    assert len(err.strip().splitlines()) <= 1, err
    assert verify_checkpoint(run / "checkpoint")["step"] == 1
    assert not [p for p in run.iterdir() if p.name.startswith(".checkpoint-")]  # no half-written save left


WRITER = """
import sys
from pathlib import Path
from k3.train.config import TrainConfig
from k3.train.loop import Trainer
tc = TrainConfig.build(overrides=dict(preset="nano", data=sys.argv[1], out=sys.argv[2], steps=100000,
                       batch_size=2, curriculum=[[0, 16]], threads=1, plot=False))
t = Trainer(tc)
t.train_step()
while not Path(sys.argv[3]).exists():
    t.save()  # every save is a new version and a pointer swap
    print(t.step, flush=True)
"""


@pytest.mark.slow
def test_readers_never_see_a_half_swapped_checkpoint(env):
    """A writer process saves over and over while this process loads the run N times."""
    from k3.infer.run_model import load_run_model

    base, data = env
    run, stop = base / "swap", base / "swap.stop"
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(data), str(run), str(stop)], cwd=REPO,
                              env=os.environ.copy(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    failures, n, t0 = [], 0, time.monotonic()
    try:
        assert writer.stdout.readline().strip() == "1", writer.stderr.read()
        while n < 60 and time.monotonic() - t0 < 120:
            try:
                model, tok = load_run_model(run)
                assert model.config.num_hidden_layers > 0 and tok.vocab_size > 0
            except Exception as e:  # noqa: BLE001 - counted
                failures.append(repr(e))
            n += 1
    finally:
        stop.touch()
        out, err = writer.communicate(timeout=60)
    saves = len(out.split())
    print(f"{n} loads during {saves} saves: {len(failures)} failures")
    assert writer.returncode == 0, err
    assert failures == [], failures
    assert n == 60 and saves >= 10, (n, saves)  # the swaps really overlapped the loads
    assert failures == [], failures
