"""``k3 env`` end to end: every step is a separate process, so sandboxes and snapshots must be
found again from the manager root."""

import json
import os
import subprocess
import sys

import pytest

from k3.cli import main
from k3.cli.env import parse_size


def k3env(root, *args, check=True):
    """``k3 env`` in a new process."""
    r = subprocess.run([sys.executable, "-m", "k3.cli", "env", "--root", root, *args],
                       capture_output=True, text=True, timeout=120)
    if check:
        assert r.returncode == 0, (args, r.stdout, r.stderr)
    return r


@pytest.fixture
def cli(manager, capsys):
    """``k3 env`` in this process (through k3.cli.main, so errors take the one-line path)."""
    def run(*args, code=0):
        got = main(["env", "--root", manager.root, *args])
        out, err = capsys.readouterr()
        assert got == code, (args, out, err)
        return out, err
    return run


def test_a_sandbox_lives_across_processes(manager, tmp_path):
    (tmp_path / "hello.txt").write_text("hi\n")
    sid = k3env(manager.root, "create", "--workspace", str(tmp_path), "--name", "cli1",
                "--memory", "256M").stdout.strip()
    assert k3env(manager.root, "exec", "cli1", "--", "cat", "hello.txt").stdout == "hi\n"
    r = k3env(manager.root, "exec", sid, "--", "sh", "-c", "echo out; echo err >&2; exit 5", check=False)
    assert (r.returncode, r.stdout, r.stderr) == (5, "out\n", "err\n")
    k3env(manager.root, "rm", "cli1")
    assert manager.list() == []


def test_snapshot_fork_restore_pause_ls_rm(manager, cli):
    sid = cli("create", "--pids", "64", "--cpus", "1")[0].strip()
    cli("exec", sid, "echo v1 > v.txt")
    snap = cli("snapshot", sid)[0].strip()
    cli("exec", sid, "echo v2 > v.txt")
    fid = cli("fork", snap, "--name", "forked")[0].strip()
    assert cli("exec", "forked", "cat v.txt")[0] == "v1\n"
    cli("restore", sid, snap)
    assert cli("exec", sid, "--", "cat", "v.txt")[0] == "v1\n"
    rows = json.loads(cli("ls", "--json")[0])
    assert {r["id"] for r in rows} == {sid, fid} and {r["name"] for r in rows} == {"forked", ""}
    assert snap in cli("ls", "--snapshots")[0]
    out, err = cli("exec", sid, "--timeout", "0.3", "--", "sleep", "30", code=124)
    assert "timed out" in err
    cli("pause", sid)
    assert "paused" in cli("exec", sid, "true", code=2)[1]
    cli("resume", sid)
    assert cli("exec", sid, "--env", "A=b", "--", "sh", "-c", "echo $A")[0] == "b\n"
    cli("rm", sid, fid)
    cli("rm", "--snapshot", snap)
    assert json.loads(cli("ls", "--json")[0]) == []
    assert "gc" not in cli("gc")[1]


def test_cli_errors_are_one_line_exit_2(cli):
    for args, needle in ((["exec", "sb-nope", "--", "true"], "unknown sandbox"),
                         (["fork", "0" * 64], "unknown snapshot"),
                         (["create", "--memory", "12Q"], "--memory"),
                         (["create", "--backend", "nope"], "unknown sandbox backend"),
                         (["exec", "x"], "no command"),
                         (["build-image", "--mirror", "http://x"], "--mirror needs --debootstrap")):
        _out, err = cli(*args, code=2)
        assert needle in err and err.count("\n") == 1, (args, err)
    assert cli("ls")[0].startswith("id")                                  # control


def test_build_image_prints_the_default_image_id(manager):
    out = k3env(manager.root, "build-image").stdout.strip()
    assert out == manager.resolve_image("default") and len(out) == 64
    assert os.path.isdir(manager.store.layer_dir(out))


@pytest.mark.parametrize("text,n", [("512M", 512 << 20), ("2G", 2 << 30), ("1024", 1024), ("1.5K", 1536),
                                    ("64MiB", 64 << 20), ("none", None)])
def test_parse_size(text, n):
    assert parse_size(text, "--memory") == n
