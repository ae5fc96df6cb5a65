"""The ``local`` backend: never implicit, loud, not isolated (and says so), but still confined
in its file methods and still bound by timeouts, output caps and cgroup limits."""

import os
import time
import warnings

import pytest

from k3.env import Limits, SandboxError
from k3.env.backends.local import NotIsolatedWarning


def test_local_is_loud_and_runs_on_the_host(manager, capsys):
    with pytest.warns(NotIsolatedWarning, match="NOT ISOLATED"):
        sb = manager.create(backend="local", limits=Limits.unlimited())
    with sb:
        assert "NOT ISOLATED" in capsys.readouterr().err
        assert sb.describe()["isolated"] is False
        with open("/etc/hostname") as f:
            host_name = f.read()
        assert sb.exec("cat /etc/hostname").text() == host_name   # the host's own file: no isolation
        sb.write_file("note.txt", "n")
        assert sb.exec("cat note.txt").text() == "n"


def test_local_refuses_network_false_which_it_cannot_enforce(manager):
    with pytest.raises(SandboxError, match="limits.network=False"):
        manager.create(backend="local", limits=Limits(network=False))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NotIsolatedWarning)
        with manager.create(backend="local", limits=Limits(network=True)) as sb:  # control
            assert sb.exec("true").ok


def test_manager_never_picks_local_by_itself(manager):
    with manager.create() as sb:
        assert sb.backend == "namespace"
        assert sb.exec("cat /etc/hostname").text() == "k3-sandbox\n"


def test_local_snapshot_fork_restore(manager):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NotIsolatedWarning)
        sb = manager.create(backend="local", limits=Limits.unlimited())
        with sb:
            sb.write_file("v.txt", "1")
            s1 = sb.snapshot()
            sb.write_file("v.txt", "2")
            sb.write_file("extra.txt", "e")
            with sb.fork(s1) as f:
                assert f.read_file("v.txt") == b"1" and not os.path.exists(
                    os.path.join(f.describe()["host_dir"], "workspace", "extra.txt"))
            sb.restore(s1)
            assert sb.read_file("v.txt") == b"1"
            assert [e.path for e in sb.list()] == ["v.txt"]


def test_local_timeout_kills_the_group_and_caps_output(manager):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NotIsolatedWarning)
        sb = manager.create(backend="local", limits=Limits.unlimited(output_bytes=100))
    with sb:
        r = sb.exec("sleep 60 & echo $! > bg.pid; sleep 60", timeout=0.5)
        assert r.timed_out and r.exit_code is None
        pid = int(sb.read_file("bg.pid"))
        for _ in range(100):                       # the background sleeper went with its group
            if not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split(") ")[1][0] == "Z":
                break
            time.sleep(0.02)
        else:
            raise AssertionError(f"pid {pid} survived the timeout")
        r = sb.exec("head -c 5000 /dev/zero")
        assert r.truncated and len(r.stdout) == 100
        assert not sb.exec("head -c 100 /dev/zero").truncated   # control: exactly the cap fits
