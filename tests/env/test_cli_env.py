"""``k3 env`` end to end: every step is a separate process, so sandboxes and snapshots must be
found again from the manager root."""

import json
import os
import subprocess
import sys

import pytest

from k3.env.cli import parse_size


def k3env(root, *args, check=True):
    r = subprocess.run([sys.executable, "-m", "k3.cli", "env", "--root", root, *args],
                       capture_output=True, text=True, timeout=120)
    if check:
        assert r.returncode == 0, (args, r.stdout, r.stderr)
    return r


def test_create_exec_snapshot_fork_restore_ls_rm_across_processes(manager, tmp_path):
    root = manager.root
    (tmp_path / "hello.txt").write_text("hi\n")
    sid = k3env(root, "create", "--workspace", str(tmp_path), "--name", "cli1", "--memory", "256M").stdout.strip()
    assert k3env(root, "exec", "cli1", "--", "cat", "hello.txt").stdout == "hi\n"
    r = k3env(root, "exec", sid, "--", "sh", "-c", "echo out; echo err >&2; exit 5", check=False)
    assert (r.returncode, r.stdout, r.stderr) == (5, "out\n", "err\n")
    k3env(root, "exec", sid, "echo v1 > v.txt")
    snap = k3env(root, "snapshot", sid).stdout.strip()
    k3env(root, "exec", sid, "echo v2 > v.txt")
    fid = k3env(root, "fork", snap).stdout.strip()
    assert k3env(root, "exec", fid, "cat v.txt").stdout == "v1\n"
    k3env(root, "restore", sid, snap)
    assert k3env(root, "exec", sid, "cat v.txt").stdout == "v1\n"
    rows = json.loads(k3env(root, "ls", "--json").stdout)
    assert {r["id"] for r in rows} == {sid, fid} and {r["name"] for r in rows} == {"cli1", ""}
    assert snap in k3env(root, "ls", "--snapshots").stdout
    r = k3env(root, "exec", sid, "--timeout", "0.3", "--", "sleep", "30", check=False)
    assert r.returncode == 124 and "timed out" in r.stderr
    k3env(root, "pause", sid)
    r = k3env(root, "exec", sid, "true", check=False)
    assert r.returncode == 2 and "paused" in r.stderr
    k3env(root, "resume", sid)
    k3env(root, "rm", sid, fid)
    k3env(root, "rm", "--snapshot", snap)
    assert json.loads(k3env(root, "ls", "--json").stdout) == []


def test_cli_errors_are_one_line_exit_2(manager):
    for args, needle in ((["exec", "sb-nope", "--", "true"], "unknown sandbox"),
                         (["fork", "0" * 64], "unknown snapshot"),
                         (["create", "--memory", "12Q"], "--memory"),
                         (["create", "--backend", "nope"], "unknown sandbox backend"),
                         (["exec", "x"], "no command")):
        r = k3env(manager.root, *args, check=False)
        assert r.returncode == 2 and needle in r.stderr and r.stderr.count("\n") == 1, (args, r.stderr)
    assert k3env(manager.root, "ls").returncode == 0                       # control


def test_build_image_prints_the_default_image_id(manager):
    out = k3env(manager.root, "build-image").stdout.strip()
    assert out == manager.resolve_image("default") and len(out) == 64
    assert os.path.isdir(manager.store.layer_dir(out))


@pytest.mark.parametrize("text,n", [("512M", 512 << 20), ("2G", 2 << 30), ("1024", 1024), ("1.5K", 1536),
                                    ("64MiB", 64 << 20), ("none", None)])
def test_parse_size(text, n):
    assert parse_size(text, "--memory") == n
