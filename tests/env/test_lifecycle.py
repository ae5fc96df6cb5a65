"""Pause/resume, snapshot/fork/restore and persistence of the namespace backend."""

import json
import os
import subprocess
import sys
import threading
import time

import pytest

from k3.env import SandboxError

COUNTER = "sh -c 'i=0; while true; do i=$((i+1)); echo $i > /tmp/count; sleep 0.02; done' >/dev/null 2>&1 &"


def _count(sb) -> int:
    return int(sb.read_file("/tmp/count").decode() or 0)


def _wait_growth(sb, above: int, timeout: float = 10.0) -> int:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            n = _count(sb)
        except (SandboxError, ValueError):
            n = -1
        if n > above:
            return n
        time.sleep(0.02)
    raise AssertionError(f"counter did not grow past {above} within {timeout} s")


def test_pause_stops_a_process_and_resume_continues_it(sandbox):
    sandbox.exec(COUNTER)
    _wait_growth(sandbox, 2)
    sandbox.pause()
    frozen = _count(sandbox)
    time.sleep(0.3)                                   # ~15 ticks if it were running
    assert _count(sandbox) == frozen
    with pytest.raises(SandboxError, match="paused"):
        sandbox.exec("true")
    sandbox.resume()
    assert _wait_growth(sandbox, frozen) > frozen     # the same process continues


def test_fork_sees_the_snapshot_while_the_original_moves_on(sandbox):
    sandbox.write_file("state.txt", "v1")
    sandbox.exec("mkdir d && echo gone > d/old.txt")
    snap = sandbox.snapshot()
    sandbox.write_file("state.txt", "v2")
    sandbox.exec("rm -r d; echo new > new.txt")
    with sandbox.fork(snap) as f:
        assert f.id != sandbox.id
        assert f.read_file("state.txt") == b"v1"
        assert f.exec("cat d/old.txt").text() == "gone\n"
        assert f.exec("test -e new.txt").exit_code == 1
        f.write_file("state.txt", "fork")
        assert sandbox.read_file("state.txt") == b"v2"   # the fork's writes stay in the fork
    assert sandbox.exec("test -e d").exit_code == 1       # the whiteout in the original still holds


def test_restore_rolls_back_files(sandbox):
    sandbox.write_file("a.txt", "before")
    snap = sandbox.snapshot()
    sandbox.write_file("a.txt", "after")
    sandbox.write_file("b.txt", "added")
    sandbox.restore(snap)
    assert sandbox.read_file("a.txt") == b"before"
    assert [e.path for e in sandbox.list()] == ["a.txt"]
    assert sandbox.exec("cat a.txt").text() == "before"
    with pytest.raises(SandboxError, match="unknown snapshot"):
        sandbox.restore("0" * 64)


def test_restore_of_a_paused_sandbox_starts_it_running(sandbox):
    sandbox.write_file("a.txt", "1")
    snap = sandbox.snapshot()
    sandbox.exec(COUNTER)
    sandbox.pause()
    sandbox.restore(snap)
    assert not sandbox.describe()["paused"]
    assert sandbox.exec("cat a.txt; test -e /tmp/count || echo no-counter").text() == "1no-counter\n"


def test_snapshot_ids_are_content_addressed(sandbox):
    sandbox.write_file("x", "same")
    a = sandbox.snapshot()
    assert sandbox.snapshot() == a                    # nothing changed: the same id
    sandbox.write_file("x", "different")
    b = sandbox.snapshot()
    assert b != a
    sandbox.write_file("x", "same")
    assert sandbox.snapshot() == a                    # back to the same content: the same id again


def test_same_size_rewrites_in_quick_succession_are_each_snapshotted(sandbox):
    ids, contents = [], [b"aaaa", b"bbbb", b"cccc"]
    for c in contents:                      # within one file-time tick: size and times may repeat
        sandbox.write_file("f.txt", c)
        ids.append(sandbox.snapshot())
    assert len(set(ids)) == 3
    for sid, c in zip(ids, contents):
        with sandbox.fork(sid) as f:
            assert f.read_file("f.txt") == c


def test_snapshots_survive_a_new_manager_process(manager):
    with manager.create() as sb:
        sb.write_file("kept.txt", "persisted")
        snap = sb.snapshot()
    code = ("import json,sys; from k3.env import SandboxManager; m = SandboxManager(sys.argv[1]);"
            "ids = [s.id for s in m.snapshots()];"
            "f = m.fork(sys.argv[2]); out = f.exec('cat kept.txt').text(); f.close();"
            "print(json.dumps({'ids': ids, 'out': out}))")
    r = subprocess.run([sys.executable, "-c", code, manager.root, snap], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    assert snap in got["ids"] and got["out"] == "persisted"


def test_twenty_forks_of_one_snapshot_run_concurrently(manager):
    with manager.create() as base:
        base.write_file("seed.txt", "s")
        snap = base.snapshot()
    forks, errors = [None] * 20, []

    def run(i):
        try:
            forks[i] = f = manager.fork(snap)
            f.exec(f"echo {i} >> seed.txt; sleep 30 >/dev/null 2>&1 &")
        except Exception as e:  # reported below
            errors.append(e)

    def close(f):
        if f is not None:
            f.close()

    try:
        threads = [threading.Thread(target=run, args=(i,)) for i in range(20)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors, errors
        # all twenty alive at once, each with its own sleeper and its own copy of the file
        assert [f.read_file("seed.txt") for f in forks] == [f"s{i}\n".encode() for i in range(20)]
        assert all(len(f.cg.pids()) >= 4 for f in forks)        # bwrap x2, agent, sleeper
        assert len({f.id for f in forks}) == 20
    finally:
        closers = [threading.Thread(target=close, args=(f,)) for f in forks]
        for t in closers:
            t.start()
        for t in closers:
            t.join(60)


def test_snapshot_stores_only_changed_files(manager, tmp_path):
    ws = tmp_path / "ws"
    ws.mkdir()
    for i in range(8):
        (ws / f"big{i}.bin").write_bytes(os.urandom(256 * 1024))
    with manager.create(workspace=str(ws)) as sb:
        before = manager.store.usage()
        sb.write_file("small.txt", "x" * 1000)
        snap = manager.snapshot_info(sb.snapshot())
        grown = manager.store.usage() - before
        assert snap.bytes == grown == 1000            # the 2 MiB workspace is not copied again
        sb.exec("head -c 5000 /dev/zero > z.bin")
        s2 = manager.snapshot_info(sb.snapshot())
        assert s2.bytes == 5000                       # small.txt is already stored: only z.bin is new
    for s in (snap, s2):
        manager.remove_snapshot(s.id)
    with pytest.raises(SandboxError, match="unknown snapshot"):
        manager.fork(snap.id)
