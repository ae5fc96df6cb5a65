"""Escape attempts from inside a namespace sandbox. Each must fail, and each has a positive control:
the same attempt succeeding on the host, through the ``local`` backend, or with isolation
relaxed (``network=True``), so a test cannot pass because the attempt never ran."""

import hashlib
import os
import secrets
import socket
import subprocess
import threading
import time
import warnings

import pytest

from k3.env import Limits
from k3.env.backends.local import NotIsolatedWarning

THIS_FILE = os.path.abspath(__file__)


@pytest.fixture
def local(manager):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NotIsolatedWarning)
        sb = manager.create(backend="local", limits=Limits.unlimited())
    yield sb
    sb.close()


def _host(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def test_host_files_are_not_visible(sandbox, local):
    for path in (THIS_FILE, "/etc/shadow", "/etc/passwd"):
        assert local.exec(["cat", path]).stdout == _host(path)          # control: the host's content
        inside = sandbox.exec(["cat", path])
        assert inside.stdout != _host(path), path
    assert sandbox.exec(["cat", THIS_FILE]).exit_code == 1               # the project is not there at all
    assert sandbox.exec("cat /etc/passwd").text().count("\n") == 2       # its own minimal /etc


def test_writes_never_reach_the_host_or_the_image(manager, sandbox, local):
    token = secrets.token_hex(6)
    target = f"/tmp/k3-escape-{token}"
    true_bin = sandbox.exec("readlink -f /usr/bin/true").text().strip()
    img_file = os.path.join(manager.store.layer_dir(sandbox.describe()["image"]), true_bin.lstrip("/"))
    before = hashlib.sha256(_host(img_file)).hexdigest()
    r = sandbox.exec(f"echo pwned > {target} && echo pwned >> {true_bin} && cat {target}")
    assert r.ok and r.text() == "pwned\n"                                # it wrote... its own layer
    assert not os.path.exists(target)
    assert hashlib.sha256(_host(img_file)).hexdigest() == before         # the read-only image is intact
    assert sandbox.exec("echo x > /.k3/agent.py").exit_code != 0          # the agent is a read-only bind
    assert sandbox.exec("echo c > /proc/sysrq-trigger").exit_code != 0
    try:                                                                  # control: local writes the host
        assert local.exec(f"echo pwned > {target}").ok and _host(target) == b"pwned\n"
    finally:
        if os.path.exists(target):
            os.unlink(target)


@pytest.fixture
def loopback_server():
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    srv.settimeout(0.2)
    got, stop = [], threading.Event()

    def serve():
        while not stop.is_set():
            try:
                c, _ = srv.accept()
            except (socket.timeout, OSError):
                continue
            with c:
                c.settimeout(2)
                try:
                    got.append(c.recv(100))
                except OSError:
                    pass

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    yield srv.getsockname()[1], got
    stop.set()
    t.join(5)
    srv.close()


CONNECT = ("import socket,sys\ntry:\n s = socket.create_connection(('127.0.0.1', {port}), 3)\n"
           " s.sendall(b'{tag}'); s.close(); print('connected')\n"
           "except OSError as e:\n print('refused', e.errno); sys.exit(3)\n")


def test_no_network_reaches_a_host_loopback_server(manager, sandbox, loopback_server):
    port, got = loopback_server
    r = sandbox.exec(["python3", "-c", CONNECT.format(port=port, tag="isolated")])
    assert r.exit_code == 3 and "refused" in r.text()
    assert sandbox.exec("cat /proc/net/dev").text().count(":") == 1      # only lo in its net namespace
    with manager.create(limits=Limits(network=True)) as open_sb:           # control: network asked for
        r = open_sb.exec(["python3", "-c", CONNECT.format(port=port, tag="allowed")])
        assert r.ok and r.text() == "connected\n"
    end = time.monotonic() + 5
    while b"allowed" not in got and time.monotonic() < end:
        time.sleep(0.02)
    assert got == [b"allowed"]


def test_memory_limit_kills_the_hog_and_reports_it(manager):
    with manager.create(limits=Limits(memory_bytes=64 << 20)) as sb:
        small = sb.exec(["python3", "-c", "x = b'a' * (16 << 20); print(len(x) >> 20)"])
        assert small.ok and small.text() == "16\n" and not small.oom_killed   # control: below the limit
        big = sb.exec(["python3", "-c", "x = b'a' * (400 << 20); print('survived')"], timeout=30)
        assert big.oom_killed and big.exit_code == 137 and b"survived" not in big.stdout
        assert sb.exec("echo still-here").text() == "still-here\n"            # the sandbox lives on
    assert subprocess.run(["true"]).returncode == 0                            # and so does the host


def test_fork_bomb_is_held_by_the_pids_limit(manager):
    with manager.create(limits=Limits(pids=48)) as sb:
        r = sb.exec("for i in $(seq 20); do sleep 30 & done; sleep 0.2; pgrep -c -x sleep")
        assert r.text() == "20\n"                                             # control: 20 processes start
        sb.exec("pkill sleep")
        t0 = time.monotonic()
        sb.exec("b() { b | b & }; b", timeout=5)
        time.sleep(1.0)
        current = max(int(open(os.path.join(d, "pids.current")).read())
                      for d in sb.cg.dirs if os.path.exists(os.path.join(d, "pids.current")))
        assert current <= 48
        assert subprocess.run(["true"]).returncode == 0                       # the host still forks
    assert time.monotonic() - t0 < 30                                          # close() ended it, bounded


def test_other_sandboxes_files_are_unreachable(manager, sandbox, local):
    sandbox.write_file("secret.txt", "s3cret")
    upper_path = os.path.join(manager.sandbox_dir(sandbox.id), "upper", "workspace", "secret.txt")
    assert local.exec(["cat", upper_path]).text() == "s3cret"                 # control: the path is right
    with manager.create() as other:
        assert other.exec(["cat", upper_path]).exit_code == 1
        assert other.exec("find / -xdev -name secret.txt").text() == ""
        assert other.exec("find / -xdev -name state.txt").text() == ""     # control below: find works
        other.write_file("state.txt", "x")
        assert other.exec("find / -xdev -name state.txt").text() == "/workspace/state.txt\n"
        assert "secret" not in other.exec("ls /workspace").text()


def test_host_processes_are_invisible(sandbox, local):
    me = str(os.getpid())
    assert me in local.exec("ls /proc").text().split()                         # control: host view
    inside = [int(p) for p in sandbox.exec("ls /proc").text().split() if p.isdigit()]
    assert max(inside) < 50 and 1 in inside
    assert "pytest" not in sandbox.exec("cat /proc/[0-9]*/cmdline 2>/dev/null | tr '\\0' ' '").text()


def test_no_process_survives_close(manager):
    sb = manager.create()
    sb.exec("sleep 300 >/dev/null 2>&1 &")
    sb.exec(["python3", "-c", "import os,time\nif os.fork() == 0:\n os.setsid()\n"
             " if os.fork() == 0: time.sleep(300)\n os._exit(0)\n"])
    pids = sb.cg.pids()
    assert len(pids) >= 5                                                      # holder, agent, sleepers
    for p in pids:
        os.kill(p, 0)                                                          # control: alive before
    sb.close()
    alive = []
    for p in pids:
        try:
            with open(f"/proc/{p}/stat") as f:
                if f.read().split(") ")[1][0] != "Z":
                    alive.append(p)
        except FileNotFoundError:
            pass
    assert alive == []


def test_symlinks_planted_in_the_workspace_stay_inside(manager, tmp_path):
    token = secrets.token_hex(6)
    ws = tmp_path / "ws"
    ws.mkdir()
    os.symlink("/etc/passwd", ws / "abs")
    os.symlink("../../../../../../../../etc/passwd", ws / "rel")
    os.symlink(f"/tmp/k3-planted-{token}", ws / "wlink")
    os.symlink("/proc/self/root/etc/passwd", ws / "magic")
    host_passwd = _host("/etc/passwd")
    assert _host(str(ws / "abs")) == host_passwd                              # control: on the host they escape
    with manager.create(workspace=str(ws)) as sb:
        own = sb.exec("cat /etc/passwd").stdout
        assert sb.read_file("abs") == own != host_passwd
        assert sb.read_file("rel") == own
        with pytest.raises(Exception):
            sb.read_file("magic")
        sb.write_file("wlink", "planted")
        assert not os.path.exists(f"/tmp/k3-planted-{token}")
        assert sb.exec(f"cat /tmp/k3-planted-{token}").text() == "planted"    # it landed inside
        sb.exec("ln -s /etc/passwd later; ln -s ../../.. up")
        assert sb.read_file("later") == own
        sb.write_file("up/etc/k3-new", "in")
        assert sb.exec("cat /etc/k3-new").text() == "in" and not os.path.exists("/etc/k3-new")
