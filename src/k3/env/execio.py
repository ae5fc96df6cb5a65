"""Running one command and collecting its output under a deadline and a byte cap.

``pump`` reads a command's stdout/stderr pipes and a control descriptor (the exec agent's socket,
or a pidfd for host processes) with one selector. Each stream keeps at most ``cap`` bytes; the
rest is read and dropped (``truncated``), so memory stays O(cap) whatever the command prints.
When the command has exited, the pipes are drained until EOF or for ``EXIT_GRACE`` seconds more
(a background process that inherited stdout would otherwise hold the result forever).
"""

from __future__ import annotations

import os
import selectors
import socket
import threading
import time
from typing import Callable

from k3.env.sandbox import ExecResult, SandboxError

__all__ = ["pump", "agent_exec", "agent_ping", "normalize_cmd", "std_pipes", "EXIT_GRACE"]

EXIT_GRACE = 0.2
DEFAULT_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin:/usr/local/sbin:/usr/sbin:/sbin",
               "HOME": "/root", "LANG": "C.UTF-8", "USER": "root", "TERM": "dumb"}


def normalize_cmd(cmd, timeout, label: str) -> list[str]:
    if isinstance(cmd, str):
        argv = ["/bin/sh", "-c", cmd]
    elif isinstance(cmd, (list, tuple)) and cmd and all(isinstance(a, str) for a in cmd):
        argv = list(cmd)
    else:
        raise SandboxError(f"sandbox {label}: cmd must be a string or a non-empty list of strings, got {cmd!r}")
    if any("\0" in a for a in argv):
        raise SandboxError(f"sandbox {label}: cmd contains a NUL byte")
    if timeout is not None and not timeout > 0:
        raise SandboxError(f"sandbox {label}: timeout must be > 0 seconds or None, got {timeout!r}")
    return argv


def _feed(fd: int, data: bytes) -> None:
    try:
        view = memoryview(data)
        while view:
            n = os.write(fd, view[:65536])
            view = view[n:]
    except OSError:  # the command closed its stdin early
        pass
    finally:
        os.close(fd)


def pump(out_r: int, err_r: int, ctl: int, on_ctl: Callable[[], int | None], kill: Callable[[], None],
         timeout: float | None, cap: int, stdin_w: int | None = None, stdin: bytes | None = None,
         chan_r: int | None = None) -> ExecResult:
    """Collect output until the command exits (``on_ctl`` returns its exit code) or the deadline.
    Closes ``out_r``/``err_r`` (and ``chan_r``: the command's fd 3, read like a third stream into
    ``ExecResult.channel``). On timeout calls ``kill`` and returns ``timed_out``."""
    t0 = time.monotonic()
    deadline = None if timeout is None else t0 + timeout
    if stdin_w is not None:
        threading.Thread(target=_feed, args=(stdin_w, stdin or b""), daemon=True).start()
    streams = (out_r, err_r) + (() if chan_r is None else (chan_r,))
    bufs = {fd: bytearray() for fd in streams}
    truncated, code, timed_out, grace_end = False, None, False, None
    sel = selectors.DefaultSelector()
    for fd in (*streams, ctl):
        sel.register(fd, selectors.EVENT_READ)
    open_streams = len(streams)
    try:
        while open_streams or code is None:
            now = time.monotonic()
            if code is not None:
                grace_end = grace_end or now + EXIT_GRACE
                wait = grace_end - now
            else:
                wait = None if deadline is None else deadline - now
            if wait is not None and wait <= 0:
                if code is None:
                    kill()
                    timed_out = True
                break
            for key, _ in sel.select(wait):
                fd = key.fd
                if fd == ctl:
                    code = on_ctl()
                    if code is not None:
                        sel.unregister(ctl)
                    continue
                data = os.read(fd, 65536)
                if not data:
                    sel.unregister(fd)
                    open_streams -= 1
                    continue
                room = cap - len(bufs[fd])
                if len(data) > room:
                    truncated = True
                bufs[fd] += data[:max(room, 0)]
    finally:
        sel.close()
        for fd in streams:
            os.close(fd)
    return ExecResult(exit_code=None if timed_out else code, stdout=bytes(bufs[out_r]),
                      stderr=bytes(bufs[err_r]), elapsed=time.monotonic() - t0, timed_out=timed_out,
                      truncated=truncated, channel=None if chan_r is None else bytes(bufs[chan_r]))


def std_pipes(with_stdin: bool) -> tuple:
    """(out_r, out_w, err_r, err_w, in_r, in_w) for one command; the stdin pair is (None, None)
    when it reads nothing."""
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    in_r, in_w = os.pipe() if with_stdin else (None, None)
    return out_r, out_w, err_r, err_w, in_r, in_w


def _connect(sock_path: str, label: str) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        s.connect(sock_path)
    except OSError as e:
        s.close()
        raise SandboxError(f"sandbox {label}: its exec agent is unreachable ({e.strerror}); is it running?") from None
    return s


def agent_ping(sock_path: str, label: str, timeout: float = 10.0) -> dict:
    s = _connect(sock_path, label)
    with s:
        s.settimeout(timeout)
        s.send(b"ping")
        try:
            data = s.recv(65536)
        except socket.timeout:
            raise SandboxError(f"sandbox {label}: exec agent did not answer within {timeout} s") from None
    parts = data.split(b"\0")
    if parts[0] != b"ok":
        raise SandboxError(f"sandbox {label}: exec agent closed the connection (did it start?)")
    return {"ok": True, "landlock": int(parts[1])}


def _encode_request(argv: list[str], env: dict, cwd: str, stdin: bool, channel: bool = False) -> bytes:
    items = [f"{k}={v}" for k, v in env.items()]
    for x in [cwd, *items]:
        if "\0" in x:
            raise SandboxError(f"exec: NUL byte in cwd or env ({x[:40]!r})")
    if any("=" in k or not k for k in env):
        raise SandboxError(f"exec: bad environment variable name in {sorted(env)}")
    fields = ["exec", ("1" if stdin else "0") + ("c" if channel else ""), cwd, str(len(argv)), *argv, str(len(items)), *items]
    return b"\0".join(os.fsencode(f) for f in fields)


def agent_exec(sock_path: str, label: str, argv: list[str], env: dict, cwd: str, timeout: float | None,
               stdin: bytes | None, cap: int, channel: bool = False) -> ExecResult:
    """One command through the sandbox's exec agent (protocol: ``k3.env.backends.agent``);
    ``channel``: the command's fd 3 is a pipe to this process, returned as ``ExecResult.channel``."""
    s = _connect(sock_path, label)
    out_r, out_w, err_r, err_w, in_r, in_w = std_pipes(stdin is not None)
    chan_r, chan_w = os.pipe() if channel else (None, None)
    try:
        req = _encode_request(argv, env, cwd, stdin is not None, channel)
        socket.send_fds(s, [req], ([in_r] if in_r is not None else []) + [out_w, err_w]
                        + ([chan_w] if channel else []))
    except BaseException:
        s.close()
        for fd in (out_r, err_r, in_w, chan_r):
            if fd is not None:
                os.close(fd)
        raise
    finally:
        for fd in (in_r, out_w, err_w, chan_w):
            if fd is not None:
                os.close(fd)
    state = {"error": None}

    def on_ctl():
        try:
            data = s.recv(65536)
        except OSError:
            data = b""
        if not data:
            state["error"] = "the exec agent died"
            return -1
        parts = data.split(b"\0")
        if parts[0] == b"error":
            state["error"] = parts[2].decode(errors="replace")
            return int(parts[1])
        return int(parts[1]) if parts[0] == b"exit" else None

    def kill():
        try:
            s.send(b"kill")
        except OSError:
            pass

    with s:
        res = pump(out_r, err_r, s.fileno(), on_ctl, kill, timeout, cap, in_w, stdin, chan_r)
    if state["error"] == "the exec agent died":
        raise SandboxError(f"sandbox {label}: the exec agent dropped the command (agent or sandbox killed?)")
    if state["error"]:
        res.stderr += f"k3 sandbox: {state['error']}\n".encode()
    return res
