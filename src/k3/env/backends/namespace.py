"""The ``namespace`` backend: bubblewrap namespaces over an overlayfs root, cgroup limits.

One sandbox = one long-lived process tree, all in the cgroup ``k3-<tag>-<id>``::

    python (preexec: join the cgroup, a private mount namespace, mount the overlay there)
      -> bwrap  (new user/pid/ipc/uts/cgroup/net namespaces, all capabilities dropped,
                 the overlay bound at /, fresh /proc and /dev)
           -> bwrap as pid 1 -> python3 /.k3/agent.py (the exec agent, k3.env.backends.agent)

The overlay: lowers = the snapshot layers (newest first) over the workspace layer over the base
image, all read-only in the manager's store; upper = ``sandboxes/<id>/upper`` (the only place a
sandbox can write), or, when ``limits.disk_bytes`` is set or the host directory cannot hold an
overlay upper layer (it is itself on overlayfs, as in many containers), ``upperfs/upper`` on a
tmpfs of that size mounted in the holder's mount namespace (its pages count against the
sandbox's memory limit; the host reaches it through ``/proc/<holder>/root``). The overlay mount exists only in the holder's private mount namespace, so
it disappears with the sandbox's last process. Commands reach the agent over a listening unix
socket made on the host (``sandboxes/<id>/ctl.sock``) and inherited by the agent: nothing inside
can see its path. File methods go through ``/proc/<pid 1>/root`` with ``openat2(RESOLVE_IN_ROOT)``.

Snapshot = freeze the cgroup, commit the upper layer to the store (content-addressed, only the
files the sandbox changed since it started), thaw. Fork = a new sandbox whose lowers include the
snapshot's layers (nothing is copied). Restore = kill the processes, empty the upper layer,
restart on the snapshot's layers. Files survive snapshot/fork/restore; process memory does not.
"""

from __future__ import annotations

import ctypes
import json
import os
import select
import shutil
import socket
import subprocess
import sys
import time

from k3.env.cgroups import Cgroup, CgroupLayout, detect_layout, refuse_unenforceable
from k3.env.execio import DEFAULT_ENV, agent_exec, agent_ping, normalize_cmd
from k3.env.fsview import FsView
from k3.env.backends.base import StateSandbox, file_layers
from k3.env.sandbox import Backend, ExecResult, FileEntry, Limits, Sandbox, SandboxError

__all__ = ["NamespaceBackend", "NamespaceSandbox"]

AGENT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "agent.py")
_libc = ctypes.CDLL(None, use_errno=True)
_CLONE_NEWNS, _CLONE_NEWUSER, _MS_REC, _MS_PRIVATE = 0x00020000, 0x10000000, 0x4000, 0x40000
# A nested sandbox (``create(nested=True)``: the verifier's) maps a second uid/gid, NESTED_UID (the
# host's nobody), and its root keeps these capabilities within its own user namespace, so that it
# can put the processes it starts into their own PID and mount namespaces under that second uid
# (k3.tasks.vharness). The capabilities reach no further than the sandbox's namespaces.
NESTED_UID = 65534
NESTED_CAPS = ("CAP_SYS_ADMIN", "CAP_SETUID", "CAP_SETGID", "CAP_SETPCAP", "CAP_CHOWN", "CAP_FOWNER",
               "CAP_DAC_OVERRIDE", "CAP_KILL")
_CHILDREN: dict[int, subprocess.Popen] = {}   # holders started by this process (reaped at close)
_MAX_MOUNT_DATA = 4000


def _bwrap() -> str:
    path = shutil.which("bwrap")
    if not path:
        raise SandboxError("namespace backend: bubblewrap (bwrap) is not installed; run `make sandbox-deps` "
                           "(apt-get install bubblewrap)")
    return path


def _on_overlayfs(path: str) -> bool:
    """True when ``path`` is on overlayfs (which cannot hold another overlay's upper layer)."""
    buf = ctypes.create_string_buffer(256)
    if _libc.statfs(os.fsencode(path), buf) != 0:
        return False
    return int.from_bytes(buf.raw[:8], sys.byteorder) == 0x794C7630  # OVERLAYFS_SUPER_MAGIC


def _sock_path(path: str) -> tuple[str, int | None]:
    """A unix socket address for ``path`` within the 107-byte limit (via /proc/self/fd)."""
    if len(path.encode()) < 100:
        return path, None
    fd = os.open(os.path.dirname(path), os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    return f"/proc/self/fd/{fd}/{os.path.basename(path)}", fd


def _holder_setup(procs: list[str], layers_dir: str, merged: str, overlay_opts: bytes, upperfs: str,
                  tmpfs_opts: bytes | None):
    """The holder's preexec function: join the cgroup, make a private mount namespace, mount the
    tmpfs upper (if any) and the overlay there. Runs in the forked child before exec(bwrap), so
    it only makes syscalls on values prepared here."""
    procs_b = [p.encode() for p in procs]
    layers_b, merged_b, upper_b = layers_dir.encode(), merged.encode(), upperfs.encode()

    def fail(what: str, code: int):
        os.write(2, f"k3: {what} failed: {os.strerror(ctypes.get_errno())}\n".encode())
        os._exit(code)

    def setup():
        for p in procs_b:
            fd = os.open(p, os.O_WRONLY)
            os.write(fd, b"0")
            os.close(fd)
        if _libc.unshare(_CLONE_NEWNS) != 0 or _libc.mount(None, b"/", None, _MS_REC | _MS_PRIVATE, None) != 0:
            fail("private mount namespace", 90)
        if tmpfs_opts is not None:
            if _libc.mount(b"k3-upper", upper_b, b"tmpfs", 0, tmpfs_opts) != 0:
                fail("tmpfs mount", 92)
            os.mkdir(upper_b + b"/upper", 0o755)
            os.mkdir(upper_b + b"/work", 0o755)
        os.chdir(layers_b)  # the lowerdir names are relative: they fit in one page of options
        if _libc.mount(b"k3-overlay", merged_b, b"overlay", 0, overlay_opts) != 0:
            fail("overlay mount", 91)

    return setup


def _nested_userns() -> tuple[subprocess.Popen, int]:
    """A user namespace mapping uid/gid 0 -> 0 and NESTED_UID -> NESTED_UID (written by this
    process, root on the host: an unprivileged one could map only itself), held by a ``cat`` that
    ends when its stdin closes; returns (that process, an fd of the namespace for bwrap)."""
    def enter():
        if _libc.unshare(_CLONE_NEWUSER) != 0:
            raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWUSER)")

    try:
        holder = subprocess.Popen(["cat"], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, env={},
                                  preexec_fn=enter, executable=shutil.which("cat") or "/bin/cat")
    except (OSError, subprocess.SubprocessError) as e:
        raise SandboxError(f"namespace backend: could not make the nested sandbox's user namespace: {e}") from None
    try:
        line = f"0 0 1\n{NESTED_UID} {NESTED_UID} 1\n"
        for name in ("uid_map", "gid_map"):
            with open(f"/proc/{holder.pid}/{name}", "w") as f:
                f.write(line)
        return holder, os.open(f"/proc/{holder.pid}/ns/user", os.O_RDONLY | os.O_CLOEXEC)
    except BaseException:
        _end_holder(holder)
        raise


def _end_holder(holder: subprocess.Popen) -> None:
    holder.stdin.close()
    holder.wait(10)


class NamespaceSandbox(StateSandbox):
    backend = "namespace"

    def __init__(self, manager, state: dict):
        super().__init__(manager, state)
        self.cg = Cgroup(state["cgroup"], CgroupLayout.from_dict(state["cgroup_layout"]))
        self._dfd: int | None = None

    # the holder -------------------------------------------------------------------------------
    def _mount_plan(self) -> tuple[bytes, bytes | None]:
        """(overlay mount options, tmpfs options for the upper layer or None); makes the dirs."""
        st = self.state
        lowers = [st["image"]] + st["layers"]
        for lid in lowers:
            self.manager.store.layer_dir(lid)
        tmpfs = st.get("upper_mode") == "tmpfs"
        for d in ("upperfs", "root") if tmpfs else ("upper", "work", "root"):
            os.makedirs(os.path.join(self.dir, d), exist_ok=True)
        base = f"{self.dir}/upperfs" if tmpfs else self.dir
        data = (f"lowerdir={':'.join(reversed(lowers))},upperdir={base}/upper,workdir={base}/work,"
                "index=off,metacopy=off,redirect_dir=off").encode()
        if len(data) > _MAX_MOUNT_DATA:
            raise SandboxError(f"sandbox {self.id}: {len(lowers)} layers exceed the overlay mount limit; "
                               "fork from a snapshot of a sandbox with fewer layers")
        size = self.limits.disk_bytes
        return data, ((f"size={size}" if size else "size=50%").encode() + b",mode=0755") if tmpfs else None

    def _bwrap_argv(self, info_w: int, listen_fd: int, userns_fd: int | None) -> tuple[list[str], int]:
        """bwrap's command line and the pipe its options come through (``--args``: so pid 1's
        cmdline, visible inside, shows no host path). ``userns_fd``: the nested sandbox's user
        namespace (``_nested_userns``) instead of one bwrap makes with uid 0 alone."""
        user = ["--unshare-user"] if userns_fd is None else ["--userns", str(userns_fd)]
        caps = [a for c in NESTED_CAPS for a in ("--cap-add", c)] if userns_fd is not None else []
        args = ["--bind", os.path.join(self.dir, "root"), "/", "--proc", "/proc", "--dev", "/dev",
                *user, "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup",
                *([] if self.limits.network else ["--unshare-net"]),
                "--uid", "0", "--gid", "0", "--hostname", "k3-sandbox", "--cap-drop", "ALL", *caps,
                "--ro-bind", AGENT, "/.k3/agent.py", "--chdir", "/", "--info-fd", str(info_w)]
        args_r, args_w = os.pipe()
        os.write(args_w, b"".join(a.encode() + b"\0" for a in args))
        os.close(args_w)
        return [_bwrap(), "--args", str(args_r),
                "--", "/usr/bin/python3", "-I", "-S", "/.k3/agent.py", str(listen_fd)], args_r

    def _start(self) -> None:
        """Mount, start the holder and wait until its exec agent answers."""
        data, tmpfs_opts = self._mount_plan()
        setup = _holder_setup(self.cg.procs_files, os.path.join(self.manager.store.root, "layers"),
                              os.path.join(self.dir, "root"), data, os.path.join(self.dir, "upperfs"), tmpfs_opts)
        sock_file = os.path.join(self.dir, "ctl.sock")
        if os.path.exists(sock_file):
            os.unlink(sock_file)
        addr, dfd = _sock_path(sock_file)
        lsock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        info_r, info_w = os.pipe()
        args_r, ns = -1, None
        try:
            lsock.bind(addr)
            lsock.listen(64)
            ns = _nested_userns() if self.state.get("nested") else None
            argv, args_r = self._bwrap_argv(info_w, lsock.fileno(), ns[1] if ns else None)
            with open(os.path.join(self.dir, "holder.log"), "wb") as log:
                p = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log, env={},
                                     pass_fds=(lsock.fileno(), info_w, args_r, *([ns[1]] if ns else [])),
                                     preexec_fn=setup, start_new_session=True)
            _CHILDREN[p.pid] = p
            os.close(info_w)
            info_w = -1
            root_pid = self._read_info(info_r, p)
        finally:
            lsock.close()
            for fd in (info_r, info_w, args_r, dfd if dfd is not None else -1, ns[1] if ns else -1):
                if fd >= 0:
                    os.close(fd)
            if ns:
                _end_holder(ns[0])
        self.state.update(pid=p.pid, root_pid=root_pid, paused=False)
        self._save()
        try:
            ans = agent_ping(self._sock(), self.id)
        except (OSError, SandboxError) as e:
            raise SandboxError(f"sandbox {self.id}: the exec agent did not start ({e}): {self._log()}") from None
        self.state["landlock"] = ans.get("landlock", 0)
        self._save()

    def _read_info(self, info_r: int, p: subprocess.Popen) -> int:
        buf, end = b"", time.monotonic() + 20
        while b"}" not in buf:
            left = end - time.monotonic()
            if left <= 0 or not select.select([info_r], [], [], left)[0]:
                break
            chunk = os.read(info_r, 4096)
            if not chunk:
                break
            buf += chunk
        if b"}" not in buf:
            if p.poll() is None:
                self.cg.kill_all()
            p.wait(5)
            raise SandboxError(f"sandbox {self.id}: the namespace holder did not start (exit {p.poll()}): "
                               f"{self._log()}")
        return int(json.loads(buf[:buf.index(b"}") + 1])["child-pid"])

    def _upper(self) -> str:
        """Host path of the writable layer (through the holder's mount namespace for tmpfs)."""
        if self.state.get("upper_mode") == "tmpfs":
            return f"/proc/{self.state['pid']}/root{self.dir}/upperfs/upper"
        return os.path.join(self.dir, "upper")

    def _log(self) -> str:
        try:
            with open(os.path.join(self.dir, "holder.log"), "rb") as f:
                return f.read().decode(errors="replace").strip()[-500:] or "(no output)"
        except OSError:
            return "(no log)"

    def _sock(self) -> str:
        path = os.path.join(self.dir, "ctl.sock")
        if len(path.encode()) < 100:
            return path
        if self._dfd is None:
            self._dfd = os.open(self.dir, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        return f"/proc/self/fd/{self._dfd}/ctl.sock"

    def _stop_holder(self) -> None:
        self.cg.kill_all()
        p = _CHILDREN.pop(self.state.get("pid", -1), None)
        if p is not None:
            p.wait(10)

    def _fs(self) -> FsView:
        self._check(running=False)
        pid = self.state["root_pid"]
        if pid not in self.cg.pids():
            raise SandboxError(f"sandbox {self.id}: its processes are gone (pid {pid} is not in its cgroup)")
        return FsView(f"/proc/{pid}/root", self.workdir, self.id)

    # Sandbox API ------------------------------------------------------------------------------
    def exec(self, cmd, timeout=60.0, stdin=None, env=None, cwd=None, channel=False) -> ExecResult:
        self._check()
        argv = normalize_cmd(cmd, timeout, self.id)
        full_env = {**DEFAULT_ENV, **(env or {})}
        wd = os.path.normpath(os.path.join(self.workdir, cwd)) if cwd else self.workdir
        before = self.cg.oom_kills()
        sock = self._sock()
        res = agent_exec(sock, self.id, argv, full_env, wd, timeout, stdin, self.limits.output_bytes, channel)
        res.oom_killed = self.cg.oom_kills() > before
        return res

    def read_file(self, path, max_bytes=None) -> bytes:
        return self._fs().read(path, max_bytes)

    def write_file(self, path, data, mode=0o644) -> None:
        self._fs().write(path, data, mode)

    def list(self, path=".", recursive=False) -> list[FileEntry]:
        return self._fs().list(path, recursive)

    def pause(self) -> None:
        self._check(running=False)
        self.cg.set_frozen(True)
        self.state["paused"] = True
        self._save()

    def resume(self) -> None:
        self._check(running=False)
        self.cg.set_frozen(False)
        self.state["paused"] = False
        self._save()

    def snapshot(self) -> str:
        self._check(running=False)
        was_paused = self.state.get("paused")
        if not was_paused:
            self.cg.set_frozen(True)
        try:
            layer, added = self.manager.store.commit_layer(self._upper())
        finally:
            if not was_paused:
                self.cg.set_frozen(False)
        return self._record_snapshot(self.state["layers"] + [layer], added)

    def restore(self, snapshot_id: str) -> None:
        self._check(running=False)
        snap = self.manager.store.snapshot(snapshot_id)
        layers, image = file_layers(snap, self.backend)
        self._stop_holder()
        if self.state.get("paused"):
            self.cg.set_frozen(False)  # a frozen cgroup would freeze the new holder too
        for d in ("upper", "work"):
            if os.path.isdir(os.path.join(self.dir, d)):
                shutil.rmtree(os.path.join(self.dir, d))
        self.state.update(image=image, layers=layers, origin=snap.id)
        self._start()

    def close(self) -> None:
        if self._closed:
            return
        self._stop_holder()
        self.cg.remove()
        if self._dfd is not None:
            os.close(self._dfd)
            self._dfd = None
        if os.path.isdir(self.dir):  # absent when another handle closed it first
            shutil.rmtree(self.dir)
        self._closed = True

    def describe(self) -> dict:
        return {**super().describe(), "layers": list(self.state["layers"]), "landlock": self.state.get("landlock", 0),
                "nested": bool(self.state.get("nested"))}


class NamespaceBackend(Backend):
    name = "namespace"

    @staticmethod
    def _refuse(limits: Limits) -> None:
        if os.geteuid() != 0:
            raise SandboxError("namespace backend: needs root (it mounts the overlay and creates cgroups on the "
                               f"host); running as uid {os.geteuid()}: run as root, or name backend='local' "
                               "(no isolation)")
        _bwrap()
        refuse_unenforceable(limits, detect_layout(), "namespace backend")

    @classmethod
    def _launch(cls, manager, sid, image, layers, limits, origin, nested) -> NamespaceSandbox:
        cls._refuse(limits)
        state = {"id": sid, "backend": cls.name, "image": image, "layers": layers, "origin": origin,
                 "nested": bool(nested),
                 "limits": limits.as_dict(), "cgroup": manager.cgroup_name(sid), "cgroup_layout": detect_layout().for_limits(limits).as_dict(),
                 "upper_mode": "tmpfs" if limits.disk_bytes or _on_overlayfs(manager.sandbox_dir(sid)) else "host",
                 "created": time.time()}
        sb = NamespaceSandbox(manager, state)
        sb.cg.create(limits)
        try:
            sb._start()
        except BaseException:
            sb._stop_holder()
            sb.cg.remove()
            raise
        return sb

    @classmethod
    def create(cls, manager, sandbox_id, image, limits, workspace, nested=False) -> Sandbox:
        cls._refuse(limits)
        layers = [manager.store.commit_layer(workspace, prefix="workspace")[0]] if workspace else []
        return cls._launch(manager, sandbox_id, image, layers, limits, None, nested)

    @classmethod
    def fork(cls, manager, snapshot, sandbox_id, limits) -> Sandbox:
        layers, image = file_layers(snapshot, cls.name)
        return cls._launch(manager, sandbox_id, image, layers, limits, snapshot.id, snapshot.meta.get("nested", False))

    @classmethod
    def attach(cls, manager, state) -> Sandbox:
        return NamespaceSandbox(manager, state)

    @staticmethod
    def alive(manager, state) -> bool:
        cg = Cgroup(state["cgroup"], CgroupLayout.from_dict(state["cgroup_layout"]))
        return state.get("root_pid") in cg.pids()
