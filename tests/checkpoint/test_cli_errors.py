"""inspect / convert / quantize through the real CLI entry point: every bad path is one stderr line
naming it, exit code 2, never a traceback; disk space is checked before writing; convert into a
directory holding a stale index never deletes files k3 did not write."""
import contextlib
import json
import shutil
import subprocess
from collections import namedtuple

import pytest
from checkpoint_models import random_model

from k3.checkpoint import from_pretrained, save_pretrained
from k3.cli import main

INDEX = "model.safetensors.index.json"


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    d = tmp_path_factory.mktemp("src") / "m"
    save_pretrained(random_model("nano"), d)
    return d


def _fails(capsys, argv, *needles):
    """Run k3 with argv; exit 2, exactly one stderr line holding every needle, no traceback."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    for n in needles:
        assert str(n) in lines[0], (n, lines[0])
    return lines[0]


@contextlib.contextmanager
def _tmpfs(path, options):
    path.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True)
    if r.returncode:
        pytest.skip(f"cannot mount a tmpfs here ({r.stderr.decode().strip()})")
    try:
        yield path
    finally:
        if subprocess.run(["umount", str(path)]).returncode:
            subprocess.run(["umount", "-l", str(path)])


@pytest.mark.parametrize("cmd", ["inspect", "convert", "quantize"])
def test_missing_source_path(tmp_path, capsys, cmd, src):
    out = [str(tmp_path / "out")] if cmd != "inspect" else []
    assert main([cmd, str(src), *out]) == 0  # positive control
    capsys.readouterr()
    missing = tmp_path / "nope"
    _fails(capsys, [cmd, str(missing), *out], missing, "no such")


@pytest.mark.parametrize("cmd", ["inspect", "convert", "quantize"])
def test_a_file_where_the_source_directory_is_expected(tmp_path, capsys, cmd):
    f = tmp_path / "file"
    f.write_text("x")
    out = [str(tmp_path / "out")] if cmd != "inspect" else []
    _fails(capsys, [cmd, str(f), *out], f, "not a directory")


@pytest.mark.parametrize("cmd", ["convert", "quantize"])
def test_a_file_where_the_output_directory_is_expected(tmp_path, capsys, cmd, src):
    f = tmp_path / "file"
    f.write_text("x")
    _fails(capsys, [cmd, str(src), str(f)], f, "not a directory")
    _fails(capsys, [cmd, str(src), str(f / "sub")], f / "sub", "not a directory")
    assert f.read_text() == "x"


@pytest.mark.parametrize("cmd", ["convert", "quantize"])
def test_read_only_output_directory(tmp_path, capsys, cmd, src):
    with _tmpfs(tmp_path / "ro", "ro,size=1m") as ro:
        _fails(capsys, [cmd, str(src), str(ro / "out")], ro / "out", "read-only")


@pytest.mark.parametrize("cmd", ["convert", "quantize"])
def test_not_enough_space_is_refused_before_writing(tmp_path, capsys, cmd, src):
    with _tmpfs(tmp_path / "small", "size=256k") as small:
        line = _fails(capsys, [cmd, str(src), str(small / "out")], small / "out", "not enough free space", "MB")
        assert "needs" in line
        assert not [p for p in (small / "out").iterdir()]  # nothing was written
    assert main([cmd, str(src), str(tmp_path / "big")]) == 0  # positive control: with room it works


def test_enospc_while_writing_names_the_file_and_leaves_no_temp(tmp_path, capsys, src, monkeypatch):
    Usage = namedtuple("Usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: Usage(1 << 40, 0, 1 << 40))  # the pre-check is fooled
    with _tmpfs(tmp_path / "small", "size=256k") as small:
        _fails(capsys, ["convert", str(src), str(small / "out")], small / "out", "no space left on device")
        assert not [p.name for p in (small / "out").iterdir()]  # the failed save removed its temp files


def _stale_index(d, listed):
    d.mkdir(parents=True, exist_ok=True)
    for name in listed:
        (d / name).write_text("user data")
    (d / INDEX).write_text(json.dumps({"metadata": {"total_size": 1}, "weight_map": {f"t{i}": n for i, n in
                                                                                       enumerate(listed)}}))


@pytest.mark.parametrize("fmt", [None, "k3"])
def test_convert_over_a_stale_index_keeps_files_k3_did_not_write(tmp_path, capsys, src, fmt):
    out = tmp_path / "out"
    listed = ["notes.txt", "model-00001-of-00002.safetensors"]
    _stale_index(out, listed)
    if fmt:  # even an index claiming k3's format cannot name arbitrary files for deletion
        idx = json.loads((out / INDEX).read_text())
        idx["metadata"]["format"] = fmt
        idx["weight_map"] = {"t0": "notes.txt"}
        (out / INDEX).write_text(json.dumps(idx))
    assert main(["convert", str(src), str(out)]) == 0
    for name in listed:
        assert (out / name).read_text() == "user data", name
    assert from_pretrained(out).config.hidden_size == 64
    # positive control: shards of a previous k3 save into the same directory are cleaned up
    first = set(json.loads((out / INDEX).read_text())["weight_map"].values())
    assert main(["convert", str(src), str(out)]) == 0
    second = set(json.loads((out / INDEX).read_text())["weight_map"].values())
    assert first.isdisjoint(second) and not any((out / s).exists() for s in first)
