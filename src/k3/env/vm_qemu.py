"""One QEMU microvm process of the ``vm`` backend: its command line, its QMP socket and the agent
channel (a virtio console in the guest, a unix socket on the host; protocol in ``k3.env.guest``).

Everything of one VM lives in its run directory (sockets, console log, QEMU's log); the process
runs in its own session, so :meth:`Qemu.kill` takes every thread and helper (the ``exec:`` shell
of a migration) with it.
"""

from __future__ import annotations

import base64
import contextlib
import itertools
import json
import os
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from k3.env.guest import WINDOW
from k3.env.sandbox import SandboxError
from k3.env.vm_image import qemu_binary

# TCG cannot calibrate the TSC against the PIT on microvm (it hangs on a loaded host): give the
# kernel its clock rates instead of letting it measure them.
CLOCK_ARGS = "tsc_early_khz=2000000 lpj=4000000 no_timer_check"


# How a migration stream is written to / read from its file (QEMU runs these with /bin/sh -c).
# zstd -1 makes a TCG guest's ~74 MB state ~16 MB (k3.env.backends.vm.CODEC chooses).
CODECS = {"none": ("cat > {p}", "cat {p}"), "zstd": ("zstd -1 -q -T1 > {p}", "zstd -d -c -q {p}")}


def codec_command(codec: str, path: Path, write: bool) -> str:
    if codec not in CODECS:
        raise SandboxError(f"vm: unknown state codec {codec!r}; known: {', '.join(CODECS)}")
    tool = CODECS[codec][0].split()[0]
    if shutil.which(tool) is None:
        raise SandboxError(f"vm: {tool} not found on PATH for the {codec} state codec; run `make vm-deps`")
    return CODECS[codec][0 if write else 1].format(p=shlex.quote(str(path)))


@dataclass(frozen=True)
class MachineConfig:
    """What a migration stream depends on: a state saved under one config loads only under it."""

    kernel: str
    initrd: str
    mem_mb: int
    smp: int
    accel: str            # "tcg" | "kvm"
    append: str

    def argv(self, rundir: Path, incoming: Path | None = None, codec: str = "none") -> list[str]:
        """QEMU's command line; it runs in ``rundir`` (socket paths are relative to it, so a deep
        run directory cannot overflow the 107-byte unix socket limit)."""
        accel = "kvm" if self.accel == "kvm" else "tcg,tb-size=64"
        cpu = "host" if self.accel == "kvm" else "qemu64"
        argv = [qemu_binary(), "-M", "microvm,pit=on,pic=on,rtc=on", "-accel", accel, "-cpu", cpu,
                "-smp", str(self.smp), "-m", f"{self.mem_mb}M", "-nodefaults", "-no-user-config",
                "-display", "none", "-monitor", "none", "-no-reboot",
                "-serial", "file:console.log",
                "-kernel", self.kernel, "-initrd", self.initrd, "-append", self.append,
                "-device", "virtio-serial-device",
                "-chardev", "socket,id=agent,path=agent.sock,server=on,wait=off",
                "-device", "virtconsole,chardev=agent",
                "-qmp", "unix:qmp.sock,server=on,wait=off",
                "-name", f"k3-vm,process=k3-vm:{rundir}"]
        if incoming is not None:
            argv += ["-incoming", "exec:" + codec_command(codec, incoming, write=False)]
        return argv


def _addr(path: Path) -> tuple[str, int | None]:
    """A unix socket address for ``path`` within the 107-byte limit (via /proc/self/fd)."""
    if len(str(path).encode()) < 100:
        return str(path), None
    fd = os.open(path.parent, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    return f"/proc/self/fd/{fd}/{path.name}", fd


def _connect(path: Path, deadline: float, alive, what: str) -> socket.socket:
    while True:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        addr, fd = _addr(path)
        try:
            s.connect(addr)
            return s
        except OSError:
            s.close()
            if not alive():
                raise SandboxError(f"vm: QEMU is not running (its {what} socket {path} is gone)")
            if time.monotonic() > deadline:
                raise SandboxError(f"vm: QEMU's {what} socket {path} did not open in time")
            time.sleep(0.02)
        finally:
            if fd is not None:
                os.close(fd)


class QMP:
    """A minimal QMP client: one command at a time, events skipped."""

    def __init__(self, sock: socket.socket):
        self.sock, self.buf = sock, b""
        self.sock.settimeout(60.0)
        self._read()  # greeting
        self.cmd("qmp_capabilities")

    def _read(self) -> dict:
        while b"\n" not in self.buf:
            chunk = self.sock.recv(65536)
            if not chunk:
                raise SandboxError("vm: QMP connection closed by QEMU")
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return json.loads(line)

    def cmd(self, name: str, **args):
        self.sock.sendall(json.dumps({"execute": name, "arguments": args}).encode() + b"\n")
        while True:
            msg = self._read()
            if "return" in msg:
                return msg["return"]
            if "error" in msg:
                raise SandboxError(f"vm: QMP {name} failed: {msg['error'].get('desc')}")


_PLAIN = frozenset(b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-+=.,:;/'\"$&|<>()[]{}!?*#@%^~`")


def printf_escape(data: bytes) -> bytes:
    """``data`` as one line that ``printf '%b'`` turns back into it: every byte outside a plain
    set (backslash, whitespace, newline, controls, non-ASCII) as ``\\0ooo``."""
    return b"".join(bytes([c]) if c in _PLAIN else b"\\0%03o" % c for c in data)


class Channel:
    """The host end of the agent's virtio console."""

    def __init__(self, sock: socket.socket):
        self.sock, self.buf = sock, b""

    def _tag(self) -> str:
        return secrets.token_hex(6)

    def _fill(self, deadline: float | None) -> None:
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            raise TimeoutError
        self.sock.settimeout(left)
        chunk = self.sock.recv(1 << 20)
        if not chunk:
            raise SandboxError("vm: agent channel closed by QEMU")
        self.buf += chunk

    def ping(self, deadline: float, alive) -> None:
        """Until the agent answers: send a ping every 0.5 s (before the agent runs, the guest's
        tty echoes them back; the tags keep that noise apart from the answer)."""
        tags: list[bytes] = []
        while True:
            tag = self._tag().encode()
            self.sock.settimeout(0)
            try:  # QEMU reads the socket only once the guest has opened its console
                if self.sock.send(b"\nK3 " + tag + b" ping\n") == 0:
                    raise SandboxError("vm: agent channel closed by QEMU")
                tags.append(tag)
            except BlockingIOError:
                pass
            step = min(deadline, time.monotonic() + 0.5)
            try:
                while True:
                    self._fill(step)
                    if any(b"K3R " + t + b" pong" in self.buf for t in tags):
                        self.buf = b""
                        return
            except TimeoutError:
                pass
            if not alive():
                raise SandboxError("vm: QEMU exited while the guest was booting")
            if time.monotonic() >= deadline:
                raise SandboxError("vm: the guest agent did not answer before the boot deadline")

    def run(self, script: bytes, stdin: bytes, timeout: float | None, cap: int,
            deadline: float | None) -> tuple[list[int], bytes, bytes]:
        """One request; returns ([rc, timed_out, oom_kills, out_size, err_size], out, err)."""
        tag = self._tag().encode()
        sb, ib = printf_escape(script), base64.b64encode(stdin)
        t = "0" if timeout is None else f"{max(timeout, 0.001):.3f}"
        self.buf = b""
        self.sock.sendall(b"K3 %s run %s %d %d %d\n" % (tag, t.encode(), cap, len(sb), len(ib)) + sb + b"\n" + ib)
        key = b"K3R " + tag + b" "
        try:
            while (i := self.buf.find(key)) < 0 or b"\n" not in self.buf[i:]:
                self._fill(deadline)
            head, rest = self.buf[i:].split(b"\n", 1)
            nums = [int(v) for v in head.split()[2:]]
            n_out, n_err = nums[5], nums[6]
            self.buf = rest
            # the guest sends stdout, then stderr, in windows of WINDOW bytes and waits for an ack
            # after each but the last (a console has no flow control of its own)
            ends = list(itertools.accumulate(_windows(n_out) + _windows(n_err)))
            for end in ends[:-1]:
                while len(self.buf) < end:
                    self._fill(deadline)
                self.sock.sendall(b"K3A " + tag + b"\n")
            while len(self.buf) < n_out + n_err:
                self._fill(deadline)
        except TimeoutError:
            raise SandboxError("vm: the guest agent did not answer in time") from None
        out, err = self.buf[:n_out], self.buf[n_out:n_out + n_err]
        self.buf = self.buf[n_out + n_err:]
        return nums[:5], out, err


def _windows(n: int) -> list[int]:
    """The sizes of the windows the guest sends ``n`` bytes in."""
    return [WINDOW] * (n // WINDOW) + ([n % WINDOW] if n % WINDOW else [])


_CHILDREN: dict[int, subprocess.Popen] = {}   # QEMUs this process started (reaped on kill)


class Qemu:
    """One QEMU process, started here (``start``) or found again from its pid (``Qemu(cfg, dir,
    pid)``, another process's VM). QMP and the agent are connected per operation: QEMU serves one
    client per socket, and any process may be the one asking."""

    def __init__(self, config: MachineConfig, rundir: Path, pid: int | None = None):
        self.config, self.rundir, self.pid = config, Path(rundir), pid

    def start(self, boot_timeout: float, incoming: Path | None = None, codec: str = "none") -> float:
        """Start QEMU (booting, or loading ``incoming``, a stream written with ``codec``) and wait
        until the agent answers;
        returns the seconds that took."""
        t0 = time.monotonic()
        self.rundir.mkdir(parents=True, exist_ok=True)
        for name in ("agent.sock", "qmp.sock"):
            (self.rundir / name).unlink(missing_ok=True)
        with open(self.rundir / "qemu.log", "ab") as log:
            proc = subprocess.Popen(self.config.argv(self.rundir, incoming, codec), cwd=self.rundir,
                                    stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True)
        _CHILDREN[proc.pid] = proc
        self.pid = proc.pid
        deadline = t0 + boot_timeout
        try:
            with self.qmp(deadline) as q:
                q.cmd("migrate-set-parameters", **{"max-bandwidth": 1 << 40})
                if incoming is not None:
                    self._await_incoming(q, deadline)
            with self.agent(deadline) as ch:
                ch.ping(deadline, self.alive)
        except (SandboxError, OSError) as e:
            tail = self.log_tail()
            self.kill()
            raise SandboxError(f"{e}; QEMU log: {tail}") from None
        return time.monotonic() - t0

    @contextlib.contextmanager
    def qmp(self, deadline: float | None = None):
        sock = _connect(self.rundir / "qmp.sock", deadline or time.monotonic() + 30, self.alive, "QMP")
        try:
            yield QMP(sock)
        finally:
            sock.close()

    @contextlib.contextmanager
    def agent(self, deadline: float | None = None):
        sock = _connect(self.rundir / "agent.sock", deadline or time.monotonic() + 30, self.alive, "agent")
        try:
            yield Channel(sock)
        finally:
            sock.close()

    def _await_incoming(self, q: "QMP", deadline: float) -> None:
        """Wait for the state to load, then start it: the stream carries the source's run state,
        which was "paused" (a snapshot stops the VM), so the loaded VM waits for ``cont``."""
        while (st := q.cmd("query-status")["status"]) == "inmigrate":
            if time.monotonic() > deadline:
                raise SandboxError("vm: loading the snapshot did not finish before the deadline")
            time.sleep(0.01)
        if st == "paused":
            q.cmd("cont")
        elif st != "running":
            raise SandboxError(f"vm: after loading the snapshot the VM is {st!r}")

    def log_tail(self, n: int = 400) -> str:
        parts = []
        for name in ("qemu.log", "console.log"):
            try:
                parts.append(name + ": " + (self.rundir / name).read_text(errors="replace")[-n:].strip())
            except OSError:
                pass
        return " | ".join(parts) or "(none)"

    def save(self, q: "QMP", path: Path, codec: str = "none") -> None:
        """Write the whole machine (CPU, devices, RAM) to ``path``; the VM must be stopped."""
        q.cmd("migrate", uri="exec:" + codec_command(codec, path, write=True))
        while True:
            st = q.cmd("query-migrate").get("status")
            if st == "completed":
                return
            if st in ("failed", "cancelled", None):
                raise SandboxError(f"vm: migration to {path} ended {st}")
            time.sleep(0.01)

    def alive(self) -> bool:
        """Our QEMU still runs: our child that has not exited, or (another process's QEMU) a
        live pid whose command line names our run directory (a reused pid is not mistaken)."""
        if self.pid is None:
            return False
        p = _CHILDREN.get(self.pid)
        if p is not None:  # our child: its cmdline may still be python's until it has exec'd
            return p.poll() is None
        try:
            with open(f"/proc/{self.pid}/cmdline", "rb") as f:
                cmd = f.read()
            with open(f"/proc/{self.pid}/stat") as f:
                zombie = f.read().rsplit(")", 1)[1].split()[0] == "Z"
        except OSError:
            return False
        return not zombie and f"process=k3-vm:{self.rundir}".encode() in cmd

    def kill(self) -> None:
        """SIGKILL QEMU's whole session and wait until it is gone (reaped if it is our child)."""
        if self.pid is None:
            return
        if self.alive():
            try:
                os.killpg(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        p = _CHILDREN.pop(self.pid, None)
        if p is not None:
            p.wait()
        else:
            end = time.monotonic() + 10
            while self.alive() and time.monotonic() < end:
                time.sleep(0.01)
