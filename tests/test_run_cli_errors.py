"""Every CLI command turns bad paths and filesystem failures into one stderr line and exit 2.

Read-only and full filesystems are real tmpfs mounts (chmod does not stop root); those tests are
skipped where this process may not mount.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from k3.cli import main
from k3.errors import CheckpointError

REPO = Path(__file__).resolve().parents[1]
STDLIB_FILES = ("textwrap.py", "csv.py", "bisect.py", "heapq.py", "colorsys.py", "fnmatch.py",
                "json/encoder.py", "json/decoder.py")
TRAIN = ["--preset", "nano", "--steps", "1", "--batch-size", "2", "--seq-len", "16", "--threads", "1",
         "--eval-interval", "0", "--final-eval-batches", "1", "--no-plot"]


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    import sysconfig
    base = tmp_path_factory.mktemp("clierr")
    data = base / "data"
    data.mkdir()
    for name in STDLIB_FILES:
        shutil.copy(Path(sysconfig.get_paths()["stdlib"]) / name, data / name.replace("/", "_"))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("K3_CACHE_DIR", str(base / "cache"))
        run = base / "run"
        assert main(["train", *TRAIN, "--data", str(data), "--out", str(run)]) == 0
        yield base, data, run


def _mount_tmpfs(where: Path, size: str, readonly: bool) -> bool:
    where.mkdir(parents=True, exist_ok=True)
    opts = f"size={size}" + (",ro" if readonly else "")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(where)], capture_output=True)
    return r.returncode == 0


@pytest.fixture
def mount(tmp_path):
    mounted: list[Path] = []

    def make(name: str, size: str = "64m", readonly: bool = False) -> Path:
        where = tmp_path / name
        if not _mount_tmpfs(where, size, readonly):
            pytest.skip("cannot mount a tmpfs here")
        mounted.append(where)
        return where

    yield make
    import gc
    gc.collect()  # a failed torch.save's file object may still hold the mount busy
    for where in reversed(mounted):
        if subprocess.run(["umount", str(where)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(where)], check=False)


def one_error_line(capsys, cmd: str) -> str:
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"k3 {cmd}: error: "), err
    assert "Traceback" not in err
    return lines[0]


def test_train_missing_path_file_in_the_way_and_positive_control(env, tmp_path, capsys):
    base, data, _ = env
    assert main(["train", *TRAIN, "--data", str(tmp_path / "nope"), "--out", str(tmp_path / "a")]) == 2
    assert str(tmp_path / "nope") in one_error_line(capsys, "train")
    afile = tmp_path / "afile"
    afile.write_text("x")
    assert main(["train", *TRAIN, "--data", str(data), "--out", str(afile)]) == 2
    assert f"{afile}: exists and is not a directory" in one_error_line(capsys, "train")
    assert main(["train", *TRAIN, "--data", str(data), "--out", str(afile / "sub")]) == 2
    line = one_error_line(capsys, "train")
    assert str(afile) in line and "not a directory" in line
    assert main(["train", *TRAIN, "--data", str(data), "--model-config", str(tmp_path / "none.json"),
                 "--out", str(tmp_path / "b")]) == 2
    assert str(tmp_path / "none.json") in one_error_line(capsys, "train")
    assert main(["train", *TRAIN, "--data", str(data), "--out", str(tmp_path / "ok")]) == 0


def test_sample_and_plot_bad_paths_and_positive_controls(env, tmp_path, capsys):
    base, data, run = env
    afile = tmp_path / "afile"
    afile.write_text("x")
    for argv, needle in ((["sample", str(tmp_path / "nope")], str(tmp_path / "nope")),
                         (["sample", str(afile)], f"{afile}: not a directory"),
                         (["sample", str(tmp_path)], "holds no checkpoint"),
                         (["plot", str(tmp_path / "nope")], "no metrics.jsonl"),
                         (["plot", str(run), "--out", str(afile / "loss.png")], "not a directory")):
        assert main(argv) == 2, argv
        assert needle in one_error_line(capsys, argv[0]), argv
    assert main(["sample", str(run), "--prompt", "", "--max-new-tokens", "2"]) == 2
    assert capsys.readouterr().out == ""  # rejected before anything was printed
    assert main(["sample", str(run), "--prompt", "x", "--max-new-tokens", "5000"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "max_position_embeddings" in err
    assert main(["sample", str(run), "--prompt", "x", "--temperature", "nan"]) == 2
    assert "--temperature" in one_error_line(capsys, "sample")
    assert main(["sample", str(run), "--prompt", "x = ", "--max-new-tokens", "3", "--seed", "0"]) == 0
    assert capsys.readouterr().out.startswith("x = ")
    assert main(["plot", str(run), "--out", str(tmp_path / "loss.png")]) == 0
    assert (tmp_path / "loss.png").stat().st_size > 0


def test_read_only_filesystem_is_one_line_for_train_plot_demo(env, mount, capsys):
    base, data, run = env
    ro = mount("ro", readonly=True)
    for argv, cmd in ((["train", *TRAIN, "--data", str(data), "--out", str(ro / "run")], "train"),
                      (["plot", str(run), "--out", str(ro / "loss.png")], "plot"),
                      (["demo", "--out", str(ro / "demo"), "--steps", "1"], "demo")):
        assert main(argv) == 2, argv
        line = one_error_line(capsys, cmd)
        assert str(ro) in line and "read-only filesystem" in line, line
    # resuming a run that lives on a read-only filesystem: the lock file cannot be created
    rw = mount("rw")
    shutil.copytree(run, rw / "run", symlinks=True)
    subprocess.run(["mount", "-o", "remount,ro", str(rw)], check=True)
    assert main(["train", "--resume", str(rw / "run"), "--steps", "2"]) == 2
    assert "read-only filesystem" in one_error_line(capsys, "train")
    subprocess.run(["mount", "-o", "remount,rw", str(rw)], check=True)
    assert main(["train", "--resume", str(rw / "run"), "--steps", "2"]) == 0  # positive control


def test_full_filesystem_is_refused_before_writing(env, mount, capsys):
    base, data, run = env
    small = mount("small", size="2m")
    assert main(["train", *TRAIN, "--data", str(data), "--out", str(small / "run")]) == 2
    line = one_error_line(capsys, "train")  # refused before the first step, not after training
    assert "not enough free space" in line and "MiB free" in line and str(small / "run") in line


def test_enospc_inside_torch_save_becomes_one_checkpoint_error(mount):
    from k3.cliutil import describe_error
    from k3.checkpoint.training import find_checkpoint, save_checkpoint

    full = mount("full", size="1m")

    def write(folder: Path) -> None:
        torch.save(torch.zeros(1 << 20), folder / "optimizer.pt")  # 4 MiB into a 1 MiB tmpfs

    with pytest.raises(RuntimeError) as raw:
        write(full)
    assert "disk full" in describe_error(raw.value)  # torch's inline_container text names no cause
    del raw
    (full / "optimizer.pt").unlink(missing_ok=True)
    with pytest.raises(CheckpointError, match=r"full/run: checkpoint of step 3 not saved: no space left on device"):
        save_checkpoint(full / "run", 3, write, need_bytes=0)
    assert find_checkpoint(full / "run") is None and not list((full / "run").iterdir())
    save_checkpoint(full / "run", 3, lambda d: torch.save(torch.zeros(8), d / "optimizer.pt"))
    assert find_checkpoint(full / "run") is not None  # positive control: a save that fits


@pytest.mark.slow
def test_debug_flag_shows_the_traceback(tmp_path):
    def k3(*argv: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "k3.cli", *argv], cwd=REPO, capture_output=True,
                              text=True, timeout=120, env=os.environ.copy())

    plain = k3("sample", str(tmp_path / "nope"))
    assert plain.returncode == 2 and "Traceback" not in plain.stderr
    assert plain.stderr.strip().count("\n") == 0 and str(tmp_path / "nope") in plain.stderr
    debug = k3("sample", str(tmp_path / "nope"), "--debug")
    assert debug.returncode != 0 and "Traceback" in debug.stderr
