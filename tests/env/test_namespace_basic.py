"""The namespace backend's everyday path: create, exec, files, list, close, attach from a new
manager object; each fact checked against what the test itself wrote or computed."""

import hashlib
import os

import pytest

from k3.env import Limits, SandboxError, SandboxManager


def test_exec_runs_inside_with_own_root_and_no_capabilities(sandbox):
    r = sandbox.exec("id -u; hostname; cat /etc/passwd | wc -l; grep CapEff /proc/self/status; pwd")
    assert r.ok, r
    uid, host, nlines, capeff, pwd = r.text().splitlines()
    assert (uid, host, pwd) == ("0", "k3-sandbox", "/workspace")
    assert int(nlines) == 2                       # root + nobody: the image's own /etc
    assert capeff.split()[1] == "0" * 16          # every capability dropped


def test_exec_argv_stdin_env_cwd_and_exit_codes(sandbox):
    data = os.urandom(200_000)
    r = sandbox.exec(["sha256sum"], stdin=data)
    assert r.ok and r.text().split()[0] == hashlib.sha256(data).hexdigest()
    assert sandbox.exec("exit 7").exit_code == 7
    assert sandbox.exec(["printenv", "K3X"], env={"K3X": "val"}).text() == "val\n"
    sandbox.exec("mkdir -p sub/dir")
    assert sandbox.exec("pwd", cwd="sub/dir").text() == "/workspace/sub/dir\n"
    r = sandbox.exec("true", cwd="no/such/dir")
    assert r.exit_code == 126 and b"cwd /workspace/no/such/dir" in r.stderr
    r = sandbox.exec(["/no/such/binary"])
    assert r.exit_code == 127 and b"No such file" in r.stderr
    r = sandbox.exec("echo out; echo err >&2")
    assert (r.stdout, r.stderr) == (b"out\n", b"err\n")


def test_files_roundtrip_between_api_and_commands(sandbox):
    sandbox.write_file("a/b/c.txt", "hello\n")
    sandbox.write_file("/tmp/x.bin", b"\x00\x01", mode=0o600)
    assert sandbox.exec("cat /workspace/a/b/c.txt").text() == "hello\n"
    assert sandbox.exec("stat -c %a /tmp/x.bin").text() == "600\n"
    sandbox.exec("printf made > made.txt; ln -s made.txt link")
    assert sandbox.read_file("made.txt") == b"made"
    assert sandbox.read_file("/workspace/link") == b"made"     # a link inside the sandbox is fine
    names = {(e.path, e.kind, e.size) for e in sandbox.list(".", recursive=True)}
    assert names == {("a", "dir", 0), ("a/b", "dir", 0), ("a/b/c.txt", "file", 6),
                     ("made.txt", "file", 4), ("link", "symlink", 0)}
    with pytest.raises(SandboxError, match="max_bytes"):
        sandbox.read_file("a/b/c.txt", max_bytes=3)
    with pytest.raises(SandboxError, match="No such file"):
        sandbox.read_file("missing.txt")


def test_workspace_files_are_copied_in(manager, tmp_path):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "main.py").write_text("print(6 * 7)\n")
    with manager.create(workspace=str(tmp_path)) as sb:
        assert sb.exec("python3 src/main.py").text() == "42\n"
        sb.exec("echo changed > src/main.py")
    assert (tmp_path / "src" / "main.py").read_text() == "print(6 * 7)\n"  # the host copy is untouched


def test_a_background_process_keeps_running_between_execs(sandbox):
    sandbox.exec("sh -c 'sleep 30' >/dev/null 2>&1 &")
    assert "sleep 30" in sandbox.exec("ps ax").text()


def test_attach_from_a_new_manager_and_close_leaves_nothing(env_root):
    m1 = SandboxManager(env_root)
    sb = m1.create(name="attach-me")
    sb.write_file("f", "1")
    sb2 = SandboxManager(env_root).get("attach-me")
    assert sb2.id == sb.id and sb2.exec("cat f").text() == "1"
    sb.pause()                                    # seen by the other handle at once
    with pytest.raises(SandboxError, match="paused"):
        sb2.exec("true")
    sb2.resume()
    snap = sb2.snapshot()
    sb2.write_file("f", "2")
    sb.restore(snap)                              # new holder: the other handle follows it
    assert sb2.read_file("f") == b"1" and sb2.exec("cat f").text() == "1"
    assert [s["id"] for s in m1.list()] == [sb.id]
    sb2.close()
    assert m1.list() == []
    with pytest.raises(SandboxError, match="closed"):
        sb2.exec("true")
    with pytest.raises(SandboxError, match="closed"):
        sb.exec("true")                           # closed by the other handle
    sb.close()                                    # and closing it again is harmless
    with pytest.raises(SandboxError, match="unknown sandbox"):
        m1.get(sb.id)


def test_unknown_backend_and_bad_limits_are_refused(manager):
    with pytest.raises(SandboxError, match="unknown sandbox backend 'nope'"):
        manager.create(backend="nope")
    with pytest.raises(SandboxError, match="limits.pids"):
        Limits(pids=0)
    with pytest.raises(SandboxError, match="limits.cpus"):
        Limits(cpus=-1)
    with manager.create(limits=Limits(pids=16, cpus=1)) as sb:  # control: valid values are accepted
        assert sb.exec("true").ok
