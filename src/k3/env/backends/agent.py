"""The exec agent: runs inside a namespace sandbox as the child of its init.

Stdlib C modules only (no json/re/socket/subprocess: they would triple its start-up time, which
is most of a fork's latency). It accepts connections on an inherited listening SOCK_SEQPACKET
unix socket (fd ``argv[1]``; the socket's path lives on the host, outside the sandbox's view).
One connection = one command; messages are NUL-separated fields (arguments cannot hold NUL):

  client -> agent  exec \\0 STDIN(0|1)[c] \\0 CWD \\0 N \\0 ARG1 .. ARGN \\0 M \\0 K=V1 .. K=VM
                   with SCM_RIGHTS fds [stdin_r if STDIN] + [stdout_w, stderr_w] + [chan_w if c]
                   (``c``: the command's fd 3 is chan_w, a channel the caller reads)
  agent -> client  pid \\0 N     then   exit \\0 CODE     (CODE = 128 + signal when killed)
                   or  error \\0 CODE \\0 MESSAGE      (126/127: the command could not start)
  client -> agent  kill, or closing the connection before the exit message:
                   SIGKILL to the command's process group
  client -> agent  ping  ->  ok \\0 LANDLOCK_ABI

Each command starts in a new session (its own process group) with oom_score_adj 500 (raising
needs no privilege; the agent stays at 0, so the memory limit's OOM kill picks commands, not it).
At start the agent sets no_new_privs and, where the kernel has Landlock ABI >= 6, restricts itself
(so every command) to a domain whose signals and abstract unix sockets cannot reach a process
outside the sandbox (this matters with ``network=True``, where the host's abstract sockets would
otherwise be reachable).
"""

import _socket
import _thread
import ctypes
import fcntl
import os
import select
import sys

_libc = ctypes.CDLL(None, use_errno=True)
_SYS_CREATE, _SYS_RESTRICT = 444, 446
_SOL_SOCKET, _SCM_RIGHTS, _SIGKILL = 1, 1, 9


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


def _recv_request(conn):
    msg, anc, _flags, _addr = conn.recvmsg(1 << 20, 64)
    fds = []
    for level, kind, data in anc:
        if level == _SOL_SOCKET and kind == _SCM_RIGHTS:
            fds += [int.from_bytes(data[i:i + 4], sys.byteorder, signed=True) for i in range(0, len(data) - 3, 4)]
    return msg.split(b"\0"), fds


def _spawn(argv, env, cwd, fds):
    """fork + execve in a new session; returns (pid, 0) or (0, errno of the failed exec)."""
    err_r, err_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(err_r)
            os.setsid()
            # copies above 0-3 first (close-on-exec, as the received originals are made): dup2 onto
            # 0..3 then clobbers none of them, and only 0..3 reach the command
            high = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 10) for fd in fds]
            for fd in fds:
                os.set_inheritable(fd, False)
            for target, fd in enumerate(high):
                os.dup2(fd, target)
            fd = os.open("/proc/self/oom_score_adj", os.O_WRONLY)
            os.write(fd, b"500")
            os.close(fd)
            os.chdir(cwd)
            os.execvpe(argv[0], argv, env)
        except OSError as e:
            os.write(err_w, str(e.errno or 1).encode())
        finally:
            os._exit(127)
    os.close(err_w)
    err = os.read(err_r, 64)
    os.close(err_r)
    if err:
        os.waitpid(pid, 0)
        return 0, int(err)
    return pid, 0


def _wait(conn, pid):
    """Wait for the command (a pidfd) while listening to the client: ``kill`` or a closed
    connection before the exit kills the command's process group. One thread, no helper."""
    pidfd = os.pidfd_open(pid)
    try:
        poller = select.poll()
        poller.register(pidfd, select.POLLIN)
        poller.register(conn.fileno(), select.POLLIN)
        listening = True
        while True:
            ready = dict(poller.poll())
            if pidfd in ready:
                break
            if listening and conn.fileno() in ready:
                try:
                    data = conn.recv(64)
                except OSError:
                    data = b""
                if not data or data == b"kill":
                    try:
                        os.killpg(pid, _SIGKILL)
                    except ProcessLookupError:
                        pass
                if not data:
                    poller.unregister(conn.fileno())
                    listening = False
        _, status = os.waitpid(pid, 0)
    finally:
        os.close(pidfd)
    code = os.waitstatus_to_exitcode(status)
    try:
        conn.send(b"exit\0%d" % (code if code >= 0 else 128 - code))
    except OSError:
        pass


def serve(conn, abi):
    def send(*fields):
        try:
            conn.send(b"\0".join(f if isinstance(f, bytes) else str(f).encode() for f in fields))
        except OSError:
            pass

    try:
        parts, fds = _recv_request(conn)
        if parts[0] == b"ping":
            send(b"ok", abi)
            return
        stdin, cwd, n = parts[1][:1] == b"1", os.fsdecode(parts[2]), int(parts[3])
        argv = [os.fsdecode(a) for a in parts[4:4 + n]]
        m = int(parts[4 + n])
        env = dict(os.fsdecode(kv).split("=", 1) for kv in parts[5 + n:5 + n + m])
        if not os.path.isdir(cwd):
            for fd in fds:
                os.close(fd)
            send(b"error", 126, f"cwd {cwd}: not a directory in the sandbox")
            return
        devnull = None if stdin else os.open("/dev/null", os.O_RDONLY)
        std = fds if stdin else [devnull] + fds
        try:
            pid, err = _spawn(argv, env, cwd, std)
        except OSError as e:  # fork failed: the pids limit is reached
            pid, err = 0, e.errno or 11
        finally:
            for fd in fds + ([devnull] if devnull is not None else []):
                os.close(fd)
        if err:
            send(b"error", 127 if err == 2 else 126, f"{argv[0]}: {os.strerror(err)}")
            return
        send(b"pid", pid)
        _wait(conn, pid)
    finally:
        conn.close()


def main() -> None:
    listen_fd = int(sys.argv[1])
    os.closerange(3, listen_fd)  # nothing else of the host (e.g. a nested sandbox's user namespace fd) stays open
    os.closerange(listen_fd + 1, 1 << 16)
    abi = landlock_scope()
    srv = _socket.socket(fileno=listen_fd)
    os.set_inheritable(listen_fd, False)
    while True:
        fd, _addr = srv._accept()
        conn = _socket.socket(fileno=fd)
        os.set_inheritable(fd, False)
        try:
            _thread.start_new_thread(serve, (conn, abi))
        except RuntimeError:  # no thread left (pids limit): refuse this one command
            conn.send(b"error\x00126\x00sandbox pids limit reached: cannot start a command")
            conn.close()


if __name__ == "__main__":
    main()
