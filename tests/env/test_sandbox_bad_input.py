"""Refusals and limits: each error names what is wrong, and leaves nothing behind (the manager
fixture's leak check runs after every test); every refusal has its accepted twin beside it."""

import os
import time
import tracemalloc

import pytest

from k3.env import Limits, SandboxError
from k3.env.cgroups import CgroupLayout, detect_layout, refuse_unenforceable
from k3.env.images import import_image


def test_unknown_and_malformed_snapshot_ids(manager, sandbox):
    good = sandbox.snapshot()
    for bad in ("0" * 64, "../../etc/passwd", "", "ZZ"):
        with pytest.raises(SandboxError, match="snapshot"):
            manager.fork(bad)
        with pytest.raises(SandboxError, match="snapshot"):
            sandbox.restore(bad)
    with manager.fork(good) as f:                                       # control: the real id works
        assert f.exec("true").ok
    with pytest.raises(SandboxError, match="unknown sandbox"):
        manager.get("sb-000000000000")


def test_every_method_after_close_raises(manager):
    sb = manager.create()
    sb.close()
    sb.close()                                                          # idempotent
    for call in (lambda: sb.exec("true"), lambda: sb.read_file("x"), lambda: sb.write_file("x", "y"),
                 lambda: sb.list(), sb.pause, sb.resume, sb.snapshot, lambda: sb.fork()):
        with pytest.raises(SandboxError, match="closed"):
            call()


def test_limits_the_machine_cannot_enforce_are_named_and_refused():
    real = detect_layout()
    refuse_unenforceable(Limits(cpus=0.5), real, "here")                # control: this machine can
    no_mem = CgroupLayout({k: v for k, v in real.dirs.items() if k != "memory"}, real.v2 - {"memory"})
    with pytest.raises(SandboxError, match=r"limits\.memory_bytes"):
        refuse_unenforceable(Limits(), no_mem, "here")
    refuse_unenforceable(Limits(memory_bytes=None), no_mem, "here")      # without that limit: accepted
    bare = CgroupLayout({}, set())
    with pytest.raises(SandboxError, match=r"limits\.memory_bytes, limits\.pids, limits\.cpus"):
        refuse_unenforceable(Limits(cpus=1.0), bare, "here")


def test_disk_limit_caps_the_writable_layer(manager):
    with manager.create(limits=Limits(disk_bytes=2 << 20)) as sb:
        assert sb.exec("head -c 1000000 /dev/urandom > ok.bin").ok                 # control: fits
        r = sb.exec("head -c 4000000 /dev/zero > big.bin")
        assert r.exit_code != 0 and b"No space left" in r.stderr
        sb.exec("rm big.bin")
        snap = sb.snapshot()                                                    # a tmpfs upper snapshots too
        data = sb.read_file("ok.bin")
    with manager.fork(snap) as f:
        assert f.read_file("ok.bin") == data and f.exec("test -e big.bin").exit_code == 1


def test_timeout_kills_the_whole_process_group(sandbox):
    t0 = time.monotonic()
    r = sandbox.exec("sleep 100 & sleep 100 & sleep 100", timeout=0.5)
    assert r.timed_out and r.exit_code is None and not r.ok
    assert time.monotonic() - t0 < 5
    end = time.monotonic() + 5
    while sandbox.exec("pgrep -c -x sleep").text() != "0\n" and time.monotonic() < end:
        time.sleep(0.05)
    assert sandbox.exec("pgrep -c -x sleep").text() == "0\n"
    r = sandbox.exec("sleep 0.1; echo done", timeout=10)                 # control: in time, it finishes
    assert r.ok and not r.timed_out and r.text() == "done\n"
    with pytest.raises(SandboxError, match="timeout"):
        sandbox.exec("true", timeout=0)


def test_output_over_the_cap_is_truncated_without_buffering_it(manager):
    with manager.create(limits=Limits(output_bytes=1000)) as sb:
        tracemalloc.start()
        try:
            r = sb.exec("head -c 200000000 /dev/zero; echo err >&2", timeout=60)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert r.ok and r.truncated and r.stdout == b"\0" * 1000 and r.stderr == b"err\n"
        assert peak < 8 << 20                                           # 200 MB went through, < 8 MB kept
        small = sb.exec("head -c 999 /dev/zero")                         # control: under the cap
        assert len(small.stdout) == 999 and not small.truncated


def test_cpu_limit_caps_cpu_time(manager):
    burn = ("import time,os\nend = time.monotonic() + {wall}\nwhile time.monotonic() < end:\n"
            " if os.times().user + os.times().system > {cap}: break\nt = os.times()\nprint(t.user + t.system)")
    with manager.create(limits=Limits(cpus=0.05)) as sb:
        used = float(sb.exec(["python3", "-c", burn.format(wall=1.0, cap=10)]).text())
        assert used <= 0.16                                             # 5 % of a core over 1 s (+ one period)
    with manager.create(limits=Limits(cpus=None)) as sb:                 # control: unlimited, it can burn
        used = float(sb.exec(["python3", "-c", burn.format(wall=8.0, cap=0.2)]).text())
        assert used > 0.2


def test_an_image_without_python_fails_cleanly(manager, tmp_path):
    empty = tmp_path / "root"
    empty.mkdir()
    image = import_image(manager.store, str(empty))
    with pytest.raises(SandboxError, match="exec agent|holder"):
        manager.create(image=image)
    assert manager.list() == [] and os.listdir(os.path.join(manager.root, "sandboxes")) == []
    with pytest.raises(SandboxError, match="unknown layer"):
        manager.create(image="f" * 64)


def test_bad_commands_and_paths(sandbox):
    for bad in ([], [1, 2], None, ["a\0b"]):
        with pytest.raises(SandboxError, match="cmd"):
            sandbox.exec(bad)
    with pytest.raises(SandboxError, match="bad path"):
        sandbox.read_file("")
    with pytest.raises(SandboxError, match="not a regular file"):
        sandbox.read_file("/tmp")
    sandbox.exec("mkfifo /tmp/fifo || python3 -c \"import os; os.mkfifo('/tmp/fifo')\"")
    t0 = time.monotonic()
    with pytest.raises(SandboxError):                                   # a planted fifo cannot hang us
        sandbox.read_file("/tmp/fifo")
    with pytest.raises(SandboxError):
        sandbox.write_file("/tmp/fifo", "x")
    assert time.monotonic() - t0 < 5
    assert sandbox.exec(["true"]).ok                                    # control


def test_not_root_is_refused_with_a_reason(manager, monkeypatch):
    # A real unprivileged run needs an interpreter and a tree readable by another user, which a
    # venv under /root is not; so the euid is faked here, the refusal path itself is real.
    with manager.create() as sb:                                         # control: as root it starts
        assert sb.exec("true").ok
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(SandboxError, match="needs root.*uid 1000.*backend='local'"):
        manager.create()
