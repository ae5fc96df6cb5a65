"""The exec agent: runs inside a namespace sandbox as the child of its init (stdlib only).

It accepts connections on an inherited listening SOCK_SEQPACKET unix socket (fd ``argv[1]``;
the socket's path lives on the host, outside the sandbox's view). One connection = one command:

  client -> agent  {"op": "exec", "argv": [...], "env": {...}, "cwd": "/workspace", "stdin": bool}
                   with SCM_RIGHTS fds [stdin_r if stdin] + [stdout_w, stderr_w]
  agent -> client  {"pid": N}  then  {"exit": code}   (code = 128 + signal when killed)
                   or {"exit": 126|127, "error": "..."} when the command cannot start
  client -> agent  {"op": "kill"} or closing the connection before the exit message:
                   SIGKILL to the command's process group
  client -> agent  {"op": "ping"} -> {"ok": true, "landlock": ABI or 0}

Each command starts in a new session (its own process group) with oom_score_adj 500 (raising
needs no privilege; the agent stays at 0, so the memory limit's OOM kill picks commands, not it). At start the agent sets
no_new_privs and, where the kernel has Landlock ABI >= 6, restricts itself (so every command) to a
domain whose signals and abstract unix sockets cannot reach a process outside the sandbox (this
matters with ``network=True``, where the host's abstract sockets would otherwise be reachable).
"""

import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import threading

_libc = ctypes.CDLL(None, use_errno=True)
_SYS_CREATE, _SYS_RESTRICT = 444, 446


class _RulesetAttr(ctypes.Structure):
    _fields_ = [("fs", ctypes.c_uint64), ("net", ctypes.c_uint64), ("scoped", ctypes.c_uint64)]


def landlock_scope() -> int:
    """Landlock ABI of the kernel (0 = none); with ABI >= 6 the calling process is restricted to
    a domain scoping signals and abstract unix sockets (filesystem and TCP stay as the
    namespaces give them: the root is the sandbox's own, loopback inside is its own)."""
    _libc.prctl(38, 1, 0, 0, 0)  # PR_SET_NO_NEW_PRIVS
    abi = _libc.syscall(_SYS_CREATE, None, 0, 1)
    if abi < 6:
        return max(abi, 0)
    attr = _RulesetAttr(0, 0, 0x3)  # LANDLOCK_SCOPE_ABSTRACT_UNIX_SOCKET | LANDLOCK_SCOPE_SIGNAL
    fd = _libc.syscall(_SYS_CREATE, ctypes.byref(attr), ctypes.sizeof(attr), 0)
    if fd < 0 or _libc.syscall(_SYS_RESTRICT, fd, 0) != 0:
        sys.exit(f"k3 agent: landlock ABI {abi} present but restrict_self failed (errno {ctypes.get_errno()})")
    os.close(fd)
    return abi


def main() -> None:
    listen_fd = int(sys.argv[1])
    abi = landlock_scope()
    srv = socket.socket(fileno=listen_fd)
    srv.set_inheritable(False)

    def child_setup():
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write("500")

    def send(conn, obj):
        try:
            conn.send(json.dumps(obj).encode())
        except OSError:
            pass

    def serve(conn):
        with conn:
            msg, fds, _flags, _addr = socket.recv_fds(conn, 1 << 20, 3)
            if not msg:
                return
            req = json.loads(msg)
            if req.get("op") == "ping":
                send(conn, {"ok": True, "landlock": abi})
                return
            stdin = fds[0] if req.get("stdin") else subprocess.DEVNULL
            try:
                p = subprocess.Popen(req["argv"], stdin=stdin, stdout=fds[-2], stderr=fds[-1],
                                     cwd=req.get("cwd") or "/", env=req.get("env") or {},
                                     start_new_session=True, preexec_fn=child_setup)
            except OSError as e:
                send(conn, {"exit": 127 if isinstance(e, FileNotFoundError) else 126,
                            "error": f"{req['argv'][0]}: {e.strerror or e}"})
                return
            finally:
                for fd in fds:
                    os.close(fd)
            send(conn, {"pid": p.pid})
            done = threading.Event()

            def watch():
                while not done.is_set():
                    try:
                        data = conn.recv(4096)
                    except OSError:
                        data = b""
                    if done.is_set():
                        return
                    if not data or json.loads(data).get("op") == "kill":
                        try:
                            os.killpg(p.pid, signal.SIGKILL)
                        except ProcessLookupError:
                            pass
                        if not data:
                            return

            threading.Thread(target=watch, daemon=True).start()
            rc = p.wait()
            done.set()
            send(conn, {"exit": rc if rc >= 0 else 128 - rc})

    while True:
        conn, _ = srv.accept()
        try:
            threading.Thread(target=serve, args=(conn,), daemon=True).start()
        except RuntimeError:  # no thread left (pids limit): refuse this one command
            send(conn, {"exit": 126, "error": "sandbox pids limit reached: cannot start a command"})
            conn.close()


if __name__ == "__main__":
    main()
