"""Start ``k3 serve CKPT`` as a subprocess on a free loopback port, and stop it: the one launcher
the tests, the chat-page browser test and ``benchmarks/serve_load.py`` share.

    with launch(ckpt_dir, "--api-key", "k", threads=1) as srv:   # blocks until /health is ok
        httpx.get(srv.url + "/v1/models")
        srv.metric("k3_active_sequences")

The server is run as ``python -m k3.cli serve CKPT --host 127.0.0.1 --port 0 FLAGS`` (the same
interpreter, the caller's environment plus ``OMP_NUM_THREADS`` when ``threads`` is given). It binds
the port itself and prints ``k3 serve: listening on http://HOST:PORT`` first; the launcher reads
that line, then polls ``GET /health`` until it answers ``{"status": "ok"}`` — both within
``start_timeout`` seconds in all, else the process is stopped and ``ServerStartError`` names what
it printed. Its stdout and stderr are drained by daemon threads (a chatty server never blocks on a
full pipe); the last lines of stderr are kept for error messages. ``stop()`` sends SIGTERM, waits
``stop_timeout`` seconds, then SIGKILLs; it is idempotent and always reaps the process.
"""

from __future__ import annotations

import collections
import json
import os
import queue
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from k3.errors import K3Error

__all__ = ["ServerProcess", "ServerStartError", "launch", "stop_process"]


class ServerStartError(K3Error):
    """``k3 serve`` exited, printed something unexpected, or was not healthy in time."""


def stop_process(proc: subprocess.Popen, timeout: float = 20.0) -> int:
    """SIGTERM ``proc``, wait up to ``timeout`` s, then SIGKILL; returns its exit status (reaped)."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


def _get(url: str, timeout: float) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:  # noqa: S310 - loopback URL we built
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


class ServerProcess:
    """A running ``k3 serve`` subprocess; ``url`` is ``http://127.0.0.1:PORT``. Context manager."""

    def __init__(self, ckpt: str | Path, *flags: str, threads: int | None = None, start_timeout: float = 120.0,
                 stop_timeout: float = 20.0, env: dict | None = None):
        self.ckpt, self.flags, self.stop_timeout = Path(ckpt), tuple(str(f) for f in flags), stop_timeout
        env = {**os.environ, **(env or {})}
        if threads is not None:
            env["OMP_NUM_THREADS"] = str(threads)
        cmd = [sys.executable, "-m", "k3.cli", "serve", str(self.ckpt), "--host", "127.0.0.1", "--port", "0",
               *self.flags]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                                     errors="replace")
        self._stdout: queue.Queue = queue.Queue()
        self._stderr: collections.deque = collections.deque(maxlen=200)
        threading.Thread(target=self._drain, args=(self.proc.stdout, self._stdout.put), daemon=True).start()
        threading.Thread(target=self._drain, args=(self.proc.stderr, self._stderr.append), daemon=True).start()
        try:
            self.url = self._wait_ready(time.monotonic() + start_timeout)
        except BaseException:
            self.stop()
            raise

    @staticmethod
    def _drain(pipe, put) -> None:
        for line in pipe:
            put(line)
        put(None)  # end of the stream: the process closed it (exited)

    def stderr_tail(self, chars: int = 2000) -> str:
        return "".join(x for x in self._stderr if x is not None)[-chars:]

    def _fail(self, why: str) -> ServerStartError:
        self.stop()
        time.sleep(0.05)  # let the drain thread take the last stderr lines
        return ServerStartError(f"k3 serve {self.ckpt}: {why}; stderr: {self.stderr_tail()!r}")

    def _wait_ready(self, deadline: float) -> str:
        try:
            first = self._stdout.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            raise self._fail("printed no 'listening on' line in time") from None
        if first is None:
            self.proc.wait(timeout=self.stop_timeout)
            raise self._fail(f"exited with status {self.proc.returncode} before listening")
        if "listening on http://" not in first:
            raise self._fail(f"unexpected first line {first!r} (exit status {self.proc.poll()})")
        url = first.split("listening on ")[1].split()[0]
        while True:
            if self.proc.poll() is not None:
                raise self._fail(f"exited with status {self.proc.returncode}")
            try:
                status, body = _get(url + "/health", timeout=5)
                if status == 200 and json.loads(body) == {"status": "ok"}:
                    return url
            except (OSError, ValueError):
                pass  # not answering yet
            if time.monotonic() > deadline:
                raise self._fail("/health was not ok in time")
            time.sleep(0.05)

    # ----------------------------------------------------------------------------- queries
    def healthy(self, timeout: float = 10.0) -> bool:
        try:
            status, body = _get(self.url + "/health", timeout)
            return status == 200 and json.loads(body) == {"status": "ok"}
        except (OSError, ValueError):
            return False

    def metrics(self, timeout: float = 30.0) -> dict[str, float]:
        """Every sample of ``GET /metrics``: the name with its labels (``a{b="c"}``) -> value."""
        status, body = _get(self.url + "/metrics", timeout)
        if status != 200:
            raise K3Error(f"GET /metrics: status {status}")
        out = {}
        for line in body.decode().splitlines():
            if line and not line.startswith("#") and " " in line:
                name, v = line.rsplit(" ", 1)
                out[name] = float(v)
        return out

    def metric(self, name: str) -> float:
        """One sample by its exact name (labels included); KeyError when absent."""
        return self.metrics()[name]

    def idle(self, timeout: float) -> bool:
        """Poll until 0 active sequences and 0 queued, at most ``timeout`` seconds."""
        end = time.monotonic() + timeout
        while True:
            m = self.metrics()
            if m["k3_active_sequences"] == 0 and m["k3_queue_depth"] == 0:
                return True
            if time.monotonic() > end:
                return False
            time.sleep(0.1)

    # ----------------------------------------------------------------------------- lifetime
    def stop(self) -> int:
        return stop_process(self.proc, self.stop_timeout)

    def __enter__(self) -> "ServerProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def launch(ckpt: str | Path, *flags: str, **kw) -> ServerProcess:
    """``ServerProcess(ckpt, *flags, **kw)``: started and healthy; use as a context manager."""
    return ServerProcess(ckpt, *flags, **kw)
