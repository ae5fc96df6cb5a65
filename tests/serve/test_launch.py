"""``k3.serve.launch``: a started server is healthy on a loopback port and gone after the ``with``;
a server that cannot start raises ``ServerStartError`` with its stderr and leaves no process;
``stop_process`` escalates to SIGKILL when SIGTERM is ignored."""

from __future__ import annotations

import signal
import subprocess
import sys
import urllib.error
import urllib.request

import pytest

from k3.serve.launch import ServerStartError, launch, stop_process


def test_launch_is_healthy_inside_the_with_and_reaped_after(ckpt):
    with launch(ckpt[0], threads=1) as srv:
        assert srv.url.startswith("http://127.0.0.1:")
        assert srv.proc.poll() is None and srv.healthy()
        assert srv.metric("k3_active_sequences") == 0
    assert srv.proc.returncode is not None  # reaped
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(srv.url + "/health", timeout=5)
    assert srv.stop() == srv.proc.returncode  # idempotent


def test_launch_of_a_missing_checkpoint_raises_with_its_stderr(tmp_path):
    with pytest.raises(ServerStartError, match="exited with status 2 before listening.*no such file") as info:
        launch(tmp_path / "missing", threads=1, start_timeout=60)
    assert str(tmp_path / "missing") in str(info.value)


def _sleeper(ignore_term: bool) -> subprocess.Popen:
    code = ("import signal, time\n"
            + ("signal.signal(signal.SIGTERM, signal.SIG_IGN)\n" if ignore_term else "")
            + "print('ready', flush=True)\ntime.sleep(60)\n")
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline() == "ready\n"  # its handler is installed before we signal it
    return p


def test_stop_process_kills_what_ignores_sigterm():
    polite = _sleeper(ignore_term=False)
    assert stop_process(polite, timeout=10) == -signal.SIGTERM  # control: SIGTERM suffices
    stubborn = _sleeper(ignore_term=True)
    assert stop_process(stubborn, timeout=0.5) == -signal.SIGKILL
    for p in (polite, stubborn):
        p.stdout.close()
