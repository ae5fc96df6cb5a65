"""The ``vm`` backend end to end: one booted QEMU microvm per module (TCG here), forks of it.

The key property: a shell process counting in RAM (a variable, never written to a file) keeps
its value across snapshot -> fork; the fork continues from the snapshot's count while the
original moves on. Every refusal has its positive control beside it.
"""

import glob
import json
import os
import subprocess
import sys
import threading
import time

import pytest

from k3.env import Limits, SandboxError, SandboxManager

pytestmark = pytest.mark.slow

LIMITS = Limits(memory_bytes=160 * 2**20, pids=32)
# A counter whose count lives only in the shell variable i: each "ask" (a line on fifo $1.q) adds
# one and answers the new value on fifo $1.a.
COUNTER = ("mkfifo /tmp/{n}.q /tmp/{n}.a && "
           "sh -c 'i=0; while :; do read -r _ < /tmp/{n}.q; i=$((i+1)); echo $i > /tmp/{n}.a; done' "
           "> /dev/null 2>&1 &")


def start_counter(sb, name: str) -> None:
    assert sb.exec(COUNTER.format(n=name)).exit_code == 0


def ask(sb, name: str, timeout: float = 20.0) -> int:
    r = sb.exec(f"echo > /tmp/{name}.q && cat /tmp/{name}.a", timeout=timeout)
    assert r.exit_code == 0 and not r.timed_out, r
    return int(r.stdout)


def processes_naming(root: str) -> list[int]:
    out = []
    for d in glob.glob("/proc/[0-9]*"):
        try:
            with open(d + "/cmdline", "rb") as f:
                if root.encode() in f.read():
                    out.append(int(d[6:]))
        except OSError:
            continue
    return out


@pytest.fixture(scope="module")
def mgr(tmp_path_factory):
    m = SandboxManager(str(tmp_path_factory.mktemp("k3vm")))
    yield m
    for s in m.list():
        m.get(s["id"]).close()
    assert os.listdir(os.path.join(m.root, "sandboxes")) == []
    assert processes_naming(m.root) == []


@pytest.fixture(scope="module")
def vm(mgr):
    sb = mgr.create(backend="vm", limits=LIMITS)
    yield sb
    sb.close()


def test_exec_round_trip_and_exit_codes(vm):
    r = vm.exec("echo out; echo err >&2; exit 3")
    assert (r.exit_code, r.stdout, r.stderr, r.timed_out) == (3, b"out\n", b"err\n", False)
    assert vm.exec(["printf", "%s|", "a b", "c"]).stdout == b"a b|c|"
    assert vm.exec("cat", stdin=b"\x00\xffraw\r\n").stdout == b"\x00\xffraw\r\n"
    assert vm.exec("echo $K3X; pwd", env={"K3X": "v 1"}, cwd="/tmp").stdout == b"v 1\n/tmp\n"
    assert vm.exec("kill -9 $$").exit_code == 128 + 9
    assert vm.exec("uname -r").text().strip().endswith("-amd64")  # the guest's kernel, not the host's
    assert vm.exec("uname -r").text().strip() != os.uname().release


def test_write_read_list_files(vm, tmp_path):
    blob = bytes(range(256)) * 40
    vm.write_file("d/sub/blob.bin", blob)
    vm.write_file("d/note.txt", "hello", mode=0o600)
    vm.exec("ln -s note.txt d/link")
    assert vm.read_file("d/sub/blob.bin") == blob
    assert vm.read_file("/workspace/d/note.txt") == b"hello"
    assert vm.exec("stat -c %a d/note.txt").text() == "600\n"
    got = {(e.path, e.kind, e.size) for e in vm.list("d", recursive=True)}
    assert got == {("sub", "dir", 0), ("sub/blob.bin", "file", len(blob)), ("note.txt", "file", 5),
                   ("link", "symlink", 0)}
    assert {e.path for e in vm.list("d")} == {"sub", "note.txt", "link"}
    with pytest.raises(SandboxError, match="no such file"):
        vm.read_file("d/missing.txt")
    tree = tmp_path / "tree"
    (tree / "in").mkdir(parents=True)
    (tree / "in" / "x.txt").write_text("from the host")
    vm._put_tree(str(tree))                        # what create(workspace=...) does
    assert vm.read_file("in/x.txt") == b"from the host"
    with pytest.raises(SandboxError, match="max_bytes"):
        vm.read_file("d/sub/blob.bin", max_bytes=100)
    assert vm.read_file("d/sub/blob.bin", max_bytes=len(blob)) == blob   # control: it fits


def test_timeout_kills_the_process_group_and_sets_timed_out(vm):
    t0 = time.monotonic()
    r = vm.exec("sleep 41 & sleep 42", timeout=1.0)
    assert r.timed_out and r.exit_code is None and time.monotonic() - t0 < 30
    assert "sleep 4" not in vm.exec("ps").text()        # both sleeps of the group are gone
    ok = vm.exec("sleep 0.2; echo done", timeout=20.0)  # control: the same kind of command in time
    assert ok.ok and ok.stdout == b"done\n"


def test_output_cap_truncates_and_flags(vm):
    cap = vm.limits.output_bytes
    r = vm.exec(f"head -c {cap + 5000} /dev/zero")
    assert r.truncated and len(r.stdout) == cap
    assert not vm.exec(f"head -c {cap} /dev/zero").truncated


def test_a_slow_reader_loses_no_output(vm, monkeypatch):
    """The host reads 4 KiB every 5 ms (about 0.8 MB/s, slower than the guest writes): every byte of
    ~1 MiB of stdout and of stderr arrives, in order. A console port has no flow control of its own;
    without the protocol's windows QEMU dropped what its socket could not take (a busy host lost
    34 KiB of a 1 MiB reply)."""
    from k3.env import vm_qemu

    def slow_fill(self, deadline):
        time.sleep(0.005)
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            raise TimeoutError
        self.sock.settimeout(left)
        chunk = self.sock.recv(4096)
        if not chunk:
            raise SandboxError("vm: agent channel closed by QEMU")
        self.buf += chunk

    want_out = "".join(f"{i}\n" for i in range(1, 120001)).encode()      # 728,895 bytes
    want_err = "".join(f"e{i}\n" for i in range(1, 40001)).encode()      # 268,894 bytes
    monkeypatch.setattr(vm_qemu.Channel, "_fill", slow_fill)
    r = vm.exec("seq 1 120000; seq 1 40000 | sed s/^/e/ >&2", timeout=120)
    assert (r.exit_code, r.truncated) == (0, False)
    assert r.stdout == want_out and r.stderr == want_err
    monkeypatch.undo()                                    # control: the normal reader, same result
    r2 = vm.exec("seq 1 120000; seq 1 40000 | sed s/^/e/ >&2", timeout=120)
    assert (r2.stdout, r2.stderr) == (want_out, want_err)


# Counts (and kills) the sleep processes of the sandbox's cgroup with shell builtins only, so it
# runs even when the pids limit leaves no room for one more process.
COUNT_KILL = ('n=0; for p in /proc/[0-9]*; do read -r c < $p/comm && [ "$c" = sleep ] && '
              'read -r g < $p/cgroup && [ "$g" = 0::/box ] && n=$((n+1)) && kill ${p##*/}; done 2>/dev/null; echo $n')

KILL_BOX = ('for p in /proc/[0-9]*; do read -r g < $p/cgroup && [ "$g" = 0::/box ] && [ ${p##*/} != $$ ] && '
            'kill -9 ${p##*/}; done 2>/dev/null; true')


def test_memory_and_pids_limits_hold_inside_the_guest(vm):
    r = vm.exec("dd if=/dev/zero of=/dev/null bs=200M count=1")   # a 200 MiB buffer > memory.max
    assert r.oom_killed and r.exit_code != 0
    small = vm.exec("dd if=/dev/zero of=/dev/null bs=16M count=1")  # control
    assert small.ok and not small.oom_killed
    bomb = vm.exec("( for i in $(seq 50); do sleep 30 & done ) 2>/dev/null; " + COUNT_KILL, timeout=60)
    assert 20 < int(bomb.stdout) < 32                               # pids.max = 32 for the box
    few = vm.exec("for i in $(seq 12); do sleep 30 & done; " + COUNT_KILL)
    assert int(few.stdout) == 12                                    # control: under the limit
    assert vm.exec("echo alive").stdout == b"alive\n"               # the agent is outside the box


def _tick_and_clock(vm) -> tuple[int, float]:
    """(the ticker's count, the guest's uptime); retried while the ticker rewrites its file."""
    for _ in range(20):
        out = vm.exec("cat /tmp/tick /proc/uptime").text().split()
        if len(out) == 3:
            return int(out[0]), float(out[1])
    raise AssertionError("the ticker never showed a count")


def test_pause_stops_a_counter_and_resume_continues(vm):
    vm.exec("sh -c 'i=0; while :; do i=$((i+1)); echo $i > /tmp/tick; sleep 0.05; done' > /dev/null 2>&1 &")
    time.sleep(1.0)
    a, ua = _tick_and_clock(vm)
    t0 = time.monotonic()
    vm.pause()
    with pytest.raises(SandboxError, match="paused"):
        vm.exec("true")
    time.sleep(3.0)                               # ~60 ticks if the guest ran
    vm.resume()
    b, ub = _tick_and_clock(vm)
    host = time.monotonic() - t0
    assert ub - ua < host - 2.5, (ua, ub, host)   # the guest lived through none of the 3 s
    assert b - a <= (ub - ua) / 0.05 + 2           # and counted only in its own time
    time.sleep(1.5)
    c, uc = _tick_and_clock(vm)
    assert c > b and uc - ub > 1.0                 # control: running, it counts on and its clock moves
    vm.exec(KILL_BOX)                              # the ticker
def test_ram_counter_survives_snapshot_then_fork(vm):
    start_counter(vm, "k")
    assert [ask(vm, "k") for _ in range(3)] == [1, 2, 3]
    snap = vm.snapshot()
    assert ask(vm, "k") == 4                       # the original moves on
    with vm.fork(snap) as f:
        assert f.id != vm.id
        assert ask(f, "k") == 4                    # the fork continues from the snapshot's 3
        assert ask(f, "k") == 5
        assert [ask(vm, "k"), ask(vm, "k")] == [5, 6]
        assert ask(f, "k") == 6                    # two processes now, each with its own i
        pid = f.state["pid"]
    assert not os.path.exists(f"/proc/{pid}")      # close() ended the fork's QEMU


def test_restore_rolls_back_files_and_memory(vm, mgr):
    vm.write_file("r.txt", "v1")
    before = vm.snapshot()                         # no counter "r" yet
    start_counter(vm, "r")
    assert [ask(vm, "r"), ask(vm, "r")] == [1, 2]
    mid = vm.snapshot()
    assert ask(vm, "r") == 3
    vm.write_file("r.txt", "v2")
    vm.restore(mid)
    assert vm.read_file("r.txt") == b"v1" and ask(vm, "r") == 3   # back at 2, counts on to 3
    vm.restore(before)
    assert vm.exec("test -p /tmp/r.q").exit_code == 1              # the counter never existed
    r = vm.exec("echo > /tmp/r.q && cat /tmp/r.a", timeout=2.0)    # negative control: no counter
    assert r.exit_code != 0 or r.timed_out
    assert {before, mid} <= {s.id for s in mgr.snapshots()}


def test_snapshot_and_sandbox_survive_a_new_controlling_process(vm, mgr):
    start_counter(vm, "p")
    assert [ask(vm, "p") for _ in range(2)] == [1, 2]
    snap = vm.snapshot()
    code = f"""
import json, sys
from k3.env import SandboxManager
m = SandboxManager({mgr.root!r})
ids = [s.id for s in m.snapshots()]
live = m.get({vm.id!r}).exec("echo > /tmp/p.q && cat /tmp/p.a").text().strip()
with m.fork({snap!r}) as f:
    forked = f.exec("echo > /tmp/p.q && cat /tmp/p.a").text().strip()
print(json.dumps({{"listed": {snap!r} in ids, "live": live, "forked": forked}}))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got == {"listed": True, "live": "3", "forked": "3"}
    assert ask(vm, "p") == 4                       # the other process's exec went to this VM


def test_bad_input_gives_sandbox_errors(vm, mgr):
    with pytest.raises(SandboxError, match="unknown snapshot"):
        mgr.fork("0" * 64)
    with pytest.raises(SandboxError, match="snapshot id"):
        vm.restore("not-an-id")
    with pytest.raises(SandboxError, match="network"):
        mgr.create(backend="vm", limits=Limits(network=True))
    with pytest.raises(SandboxError, match="env name"):
        vm.exec("true", env={"A B": "1"})
    assert vm.exec("true").ok                      # control: the sandbox still works


def test_exec_after_close_and_nothing_left_behind(vm, mgr):
    sb = vm.fork()
    assert sb.exec("echo up").stdout == b"up\n"    # control: before close
    pid, d = sb.state["pid"], sb.dir
    sb.close()
    sb.close()                                     # idempotent
    for call in (lambda: sb.exec("true"), lambda: sb.read_file("x"), sb.snapshot, sb.pause):
        with pytest.raises(SandboxError, match="after close"):
            call()
    assert not os.path.exists(f"/proc/{pid}") and not d.exists()
    assert sb.id not in {s["id"] for s in mgr.list()}


def test_concurrent_execs_are_served_one_by_one(vm):
    got = {}

    def worker(i):
        got[i] = [vm.exec(f"echo {i}-{j}; sleep 0.05").stdout for j in range(3)]

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert got == {i: [f"{i}-{j}\n".encode() for j in range(3)] for i in range(3)}


def test_gc_closes_a_vm_whose_qemu_died(vm, mgr):
    f = vm.fork()
    live = mgr.gc()["sandboxes_closed"]
    assert f.id not in live                        # control: a running VM is kept
    os.kill(f.state["pid"], 9)
    f._qemu.kill()                                 # reap our child
    assert f.id in mgr.gc()["sandboxes_closed"]
    assert f.id not in {s["id"] for s in mgr.list()} and not f.dir.exists()


def test_disk_and_cpu_limits_of_a_second_machine(mgr):
    lim = Limits(memory_bytes=96 * 2**20, pids=32, cpus=0.5, disk_bytes=4 * 2**20)
    with mgr.create(backend="vm", limits=lim) as sb:
        assert sb.exec("cat /sys/fs/cgroup/box/cpu.max").stdout == b"50000 100000\n"
        full = sb.exec("dd if=/dev/zero of=/workspace/big bs=1M count=8")
        assert full.exit_code != 0 and b"No space" in full.stderr   # the 4 MiB workspace is full
        sb.exec("rm -f /workspace/big")
        assert sb.exec("dd if=/dev/zero of=/workspace/ok bs=1M count=2").ok   # control: it fits
        assert sb.exec("dd if=/dev/zero of=/tmp/outside bs=1M count=8").ok    # control: /tmp is not capped


def test_zstd_state_codec_keeps_the_counter_and_shrinks_the_file(vm, mgr, monkeypatch):
    from k3.env.backends import vm as vm_backend
    start_counter(vm, "z")
    assert ask(vm, "z") == 1
    raw = vm.snapshot_info()
    monkeypatch.setattr(vm_backend, "CODEC", "zstd")
    packed = vm.snapshot_info()
    assert (raw.meta["codec"], packed.meta["codec"]) == ("none", "zstd")
    assert packed.meta["state_bytes"] < raw.meta["state_bytes"] / 2
    with mgr.fork(packed.id) as f:
        assert ask(f, "z") == 2                    # the compressed state carries the same process
    with mgr.fork(raw.id) as f:
        assert ask(f, "z") == 2                    # control: the uncompressed one


def test_snapshots_do_not_cross_backends(vm, mgr):
    vm_snap = vm.snapshot()
    with mgr.create() as ns:                       # a namespace sandbox of the same manager
        ns_snap = ns.snapshot()
    with pytest.raises(SandboxError, match="only from vm snapshots"):
        mgr.fork(ns_snap, backend="vm")
    with pytest.raises(SandboxError, match="file-layer snapshots"):
        mgr.fork(vm_snap, backend="namespace")
    with mgr.fork(vm_snap) as f:                   # control: each kind forks in its own backend
        assert f.backend == "vm" and f.exec("echo ok").stdout == b"ok\n"
    with mgr.fork(ns_snap) as g:
        assert g.backend == "namespace" and g.exec(["echo", "ok"]).stdout == b"ok\n"
