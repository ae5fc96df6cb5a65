"""Run directories: one owner (flock, across real processes), no takeover of foreign folders,
default --out names, paths stored absolute and the corpus checked on resume."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from k3.errors import K3Error
from k3.cli.train import build_train_parser, train_config_from_args, train_main
from k3.checkpoint.rundir import LOCK_NAME, MARKER_NAME, RunDirBusy, RunLock, check_foreign_dir
from k3.checkpoint.training import find_checkpoint, load_trainer_state

REPO = Path(__file__).resolve().parents[2]
TRAIN = "import sys; from k3.cli.train import train_main; sys.exit(train_main(sys.argv[1:]))"


def _args(data: Path, *extra: str) -> list[str]:
    return ["--preset", "nano", "--data", str(data), "--batch-size", "2", "--seq-len", "16",
            "--threads", "1", "--eval-interval", "0", "--final-eval-batches", "1", "--no-plot", *extra]


def _k3_train(argv: list[str], cwd: Path = REPO, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", TRAIN, *argv], cwd=cwd, env=os.environ.copy(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


def _wait_for(cond, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.1)
    return False


def test_lock_is_exclusive_across_processes_and_released_by_exit(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from k3.checkpoint.rundir import RunLock; "
                               f"RunLock({str(run)!r}).acquire(); print('held', flush=True); time.sleep(60)"],
                              env=os.environ.copy(), stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        assert (run / LOCK_NAME).read_text().strip() == str(holder.pid)
        with pytest.raises(RunDirBusy, match=f"PID {holder.pid}"):
            RunLock(run).acquire()
    finally:
        holder.kill()
        holder.wait()
    # the lock file stays behind with the dead PID in it, but the flock died with the process
    assert (run / LOCK_NAME).read_text().strip() == str(holder.pid)
    with RunLock(run):
        assert (run / LOCK_NAME).read_text().strip() == str(os.getpid())
        with RunLock(run):  # re-entrant within one process
            pass
    with RunLock(run):  # released when the outermost holder left
        pass


@pytest.mark.slow
def test_second_k3_train_on_a_busy_run_exits_at_once_naming_the_pid(env):
    base, data = env
    run = base / "busy"
    first = _k3_train(_args(data, "--out", str(run), "--steps", "100000", "--ckpt-interval", "1"))
    try:
        ok = _wait_for(lambda: find_checkpoint_safe(run), 90)
        assert ok, first.stderr.read() if first.poll() is not None else "no checkpoint within 90 s"
        for argv in (_args(data, "--out", str(run), "--steps", "2", "--overwrite"), ["--resume", str(run)]):
            t0 = time.monotonic()
            second = subprocess.run([sys.executable, "-c", TRAIN, *argv], cwd=REPO, env=os.environ.copy(),
                                    capture_output=True, text=True, timeout=60)
            assert second.returncode == 2, second.stderr
            assert f"in use by another k3 process (PID {first.pid}" in second.stderr
            assert second.stderr.count("\n") == 1 and "Traceback" not in second.stderr
            assert time.monotonic() - t0 < 30
    finally:
        first.send_signal(signal.SIGKILL)  # kill -9: the lock file stays, the flock does not
        first.wait()
    assert (run / LOCK_NAME).read_text().strip() == str(first.pid)
    step = load_trainer_state(find_checkpoint(run))["step"]
    r = subprocess.run([sys.executable, "-c", TRAIN, "--resume", str(run), "--steps", str(step + 1)],
                       cwd=REPO, env=os.environ.copy(), capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert load_trainer_state(find_checkpoint(run))["step"] == step + 1


def find_checkpoint_safe(run: Path) -> bool:
    try:
        return find_checkpoint(run) is not None
    except (K3Error, OSError):
        return False


def test_foreign_folders_are_refused_and_k3_folders_accepted(env, capsys):
    base, data = env
    foreign = base / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    assert train_main(_args(data, "--out", str(foreign), "--steps", "1")) == 2
    err = capsys.readouterr().err
    assert "not a k3 run directory" in err and str(foreign) in err
    assert sorted(p.name for p in foreign.iterdir()) == ["notes.txt"]  # not even a lock file added
    afile = base / "afile"
    afile.write_text("x")
    with pytest.raises(K3Error, match="not a directory"):
        check_foreign_dir(afile)
    # positive controls: an empty folder, and a folder k3 created, are accepted
    empty = base / "emptyrun"
    empty.mkdir()
    assert train_main(_args(data, "--out", str(empty), "--steps", "1")) == 0
    assert json.loads((empty / MARKER_NAME).read_text())["created_by"] == "k3 train"
    (empty / "checkpoint").unlink()
    for v in empty.glob("checkpoint-*"):
        import shutil
        shutil.rmtree(v)
    assert train_main(_args(data, "--out", str(empty), "--steps", "1")) == 0  # marked, no checkpoint


def test_default_out_follows_the_trained_model(env, tmp_path):
    base, data = env

    def out_of(*argv: str) -> str:
        return train_config_from_args(build_train_parser().parse_args(list(argv))).out

    assert out_of("--preset", "small") == "runs/small"
    assert out_of("--preset", "nano", "--out", "elsewhere") == "elsewhere"
    from k3.config import get_preset
    cfg_dir = tmp_path / "my-model"
    cfg_dir.mkdir()
    get_preset("nano").to_json(cfg_dir / "config.json")
    assert out_of("--model-config", str(cfg_dir / "config.json")) == "runs/my-model"
    assert out_of("--model-config", str(cfg_dir)) == "runs/my-model"
    (tmp_path / "wide.json").write_text((cfg_dir / "config.json").read_text())
    assert out_of("--model-config", str(tmp_path / "wide.json")) == "runs/wide"


def test_resume_from_another_directory_and_changed_corpus_is_named(env, tmp_path, capsys):
    base, data = env
    import shutil
    work = tmp_path / "work"
    shutil.copytree(data, work / "corpus")
    cwd = os.getcwd()
    os.chdir(work)
    try:
        assert train_main(_args(Path("corpus"), "--out", "run", "--steps", "1")) == 0
    finally:
        os.chdir(cwd)
    run = work / "run"
    tc = load_trainer_state(find_checkpoint(run))["train_config"]
    assert tc["data"] == str(work / "corpus")
    os.chdir(tmp_path)  # another working directory: the relative 'corpus' would not resolve here
    try:
        assert train_main(["--resume", str(run), "--steps", "2"]) == 0
        (work / "corpus" / "csv.py").write_text((work / "corpus" / "csv.py").read_text() + "\n# edited\n")
        assert train_main(["--resume", str(run), "--steps", "3"]) == 2
    finally:
        os.chdir(cwd)
    err = capsys.readouterr().err
    assert "corpus" in err and "changed: csv.py" in err


def test_relative_model_config_is_stored_absolute(env, tmp_path):
    from k3.config import get_preset
    from k3.train.config import TrainConfig
    from k3.train.runinfo import absolute_paths

    get_preset("nano").to_json(tmp_path / "config.json")
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        tc = absolute_paths(TrainConfig.build(overrides={"model_config": "config.json", "data": "corpus"}))
    finally:
        os.chdir(cwd)
    assert tc.model_config == str(tmp_path / "config.json") and tc.data == str(tmp_path / "corpus")
    already = TrainConfig.build(overrides={"model_config": str(tmp_path / "config.json")})
    assert absolute_paths(already).model_config == str(tmp_path / "config.json")  # unchanged


def test_a_run_of_older_k3_without_marker_gets_one_on_resume(env, capsys):
    base, data = env
    run = base / "old"
    assert train_main(_args(data, "--out", str(run), "--steps", "1")) == 0
    (run / MARKER_NAME).unlink()  # as written before markers existed
    assert train_main(_args(data, "--out", str(run), "--steps", "2", "--overwrite")) == 2
    assert "not a k3 run directory" in capsys.readouterr().err  # unmarked: refused even so
    assert train_main(["--resume", str(run), "--steps", "2"]) == 0
    assert json.loads((run / MARKER_NAME).read_text())["created_by"] == "k3 train"
    assert train_main(_args(data, "--out", str(run), "--steps", "1", "--overwrite")) == 0
    assert load_trainer_state(find_checkpoint(run))["step"] == 1

