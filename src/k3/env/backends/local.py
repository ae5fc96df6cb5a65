"""The ``local`` backend: NO isolation. Commands run on this host, as this user, with the host's
filesystem, network and processes in reach. For machines without namespaces; never chosen
unless named, and every create says so (``NotIsolatedWarning`` + a line on stderr).

What it does keep: a private directory per sandbox (``sandboxes/<id>/fs``, its ``/workspace``
is the command's working directory), file methods confined to that directory (same
``openat2(RESOLVE_IN_ROOT)`` as the namespace backend), cgroup limits/pause where the machine has
them (else pause is SIGSTOP to every process group it started), timeouts and output caps.
Snapshots commit the whole directory to the store (deduplicated per file); fork and restore copy
the layers back into a directory. ``limits.network=False`` cannot be enforced and is refused.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
import warnings

from k3.env.cgroups import Cgroup, CgroupLayout, detect_layout, refuse_unenforceable
from k3.env.execio import DEFAULT_ENV, normalize_cmd, pump, std_pipes
from k3.env.fsview import FsView
from k3.env.layers import materialize
from k3.env.backends.base import StateSandbox, file_layers
from k3.env.sandbox import Backend, ExecResult, FileEntry, Sandbox, SandboxError

__all__ = ["LocalBackend", "LocalSandbox", "NotIsolatedWarning"]


class NotIsolatedWarning(UserWarning):
    """Raised (as a warning) for every ``local`` sandbox: it is not a sandbox."""


class LocalSandbox(StateSandbox):
    backend = "local"

    def __init__(self, manager, state: dict):
        super().__init__(manager, state)
        self.fs_root = os.path.join(self.dir, "fs")
        lay = state.get("cgroup_layout")
        self.cg = Cgroup(state["cgroup"], CgroupLayout.from_dict(lay)) if lay else None

    def _host(self, sandbox_path: str) -> str:
        rel = FsView(self.fs_root, self.workdir, self.id).rel(sandbox_path)
        return os.path.join(self.fs_root, rel)

    def exec(self, cmd, timeout=60.0, stdin=None, env=None, cwd=None, channel=False) -> ExecResult:
        if channel:
            raise SandboxError("local backend: exec(channel=True) is not implemented (the namespace backend has it)")
        self._check()
        argv = normalize_cmd(cmd, timeout, self.id)
        wd = self._host(cwd or self.workdir)
        full_env = {**DEFAULT_ENV, "HOME": os.path.join(self.fs_root, "root"), **(env or {})}
        before = self.cg.oom_kills() if self.cg else 0
        out_r, out_w, err_r, err_w, in_r, in_w = std_pipes(stdin is not None)
        try:
            p = subprocess.Popen(argv, cwd=wd, env=full_env, stdin=in_r if in_r is not None else subprocess.DEVNULL,
                                 stdout=out_w, stderr=err_w, start_new_session=True,
                                 preexec_fn=self.cg.join_self if self.cg else None)
        except OSError as e:
            for fd in (out_r, err_r, in_w):
                if fd is not None:
                    os.close(fd)
            return ExecResult(127 if isinstance(e, FileNotFoundError) else 126, b"",
                              f"k3 sandbox: {argv[0]}: {e.strerror}\n".encode(), 0.0)
        finally:
            for fd in (out_w, err_w, in_r):
                if fd is not None:
                    os.close(fd)
        self.state.setdefault("pgids", []).append(p.pid)
        self._save()
        pidfd = os.pidfd_open(p.pid)

        def on_ctl():
            rc = p.wait()
            return rc if rc >= 0 else 128 - rc

        def kill():
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()

        try:
            res = pump(out_r, err_r, pidfd, on_ctl, kill, timeout, self.limits.output_bytes, in_w, stdin)
        finally:
            os.close(pidfd)
        res.oom_killed = bool(self.cg) and self.cg.oom_kills() > before
        return res

    def read_file(self, path, max_bytes=None) -> bytes:
        self._check(running=False)
        return FsView(self.fs_root, self.workdir, self.id).read(path, max_bytes)

    def write_file(self, path, data, mode=0o644) -> None:
        self._check(running=False)
        FsView(self.fs_root, self.workdir, self.id).write(path, data, mode)

    def list(self, path=".", recursive=False) -> list[FileEntry]:
        self._check(running=False)
        return FsView(self.fs_root, self.workdir, self.id).list(path, recursive)

    def _signal_groups(self, sig: int) -> None:
        for pg in self.state.get("pgids", []):
            try:
                os.killpg(pg, sig)
            except (ProcessLookupError, PermissionError):
                pass

    def pause(self) -> None:
        self._check(running=False)
        if self.cg and self.cg.layout.supports("freezer"):
            self.cg.set_frozen(True)
        else:
            self._signal_groups(signal.SIGSTOP)
        self.state["paused"] = True
        self._save()

    def resume(self) -> None:
        self._check(running=False)
        if self.cg and self.cg.layout.supports("freezer"):
            self.cg.set_frozen(False)
        else:
            self._signal_groups(signal.SIGCONT)
        self.state["paused"] = False
        self._save()

    def snapshot(self) -> str:
        self._check(running=False)
        layer, added = self.manager.store.commit_layer(self.fs_root)
        return self._record_snapshot([layer], added)

    def _kill_all(self) -> None:
        if self.cg:
            self.cg.kill_all()  # kills frozen processes too (cgroups.Cgroup.kill_all thaws v1)
        self._signal_groups(signal.SIGKILL)
        self._signal_groups(signal.SIGCONT)

    def restore(self, snapshot_id: str) -> None:
        self._check(running=False)
        snap = self.manager.store.snapshot(snapshot_id)
        layers = LocalBackend.layer_dirs(self.manager, snap)
        self._kill_all()
        shutil.rmtree(self.fs_root)
        materialize(layers, self.fs_root)
        self.state.update(origin=snap.id, paused=False, pgids=[])
        self._save()

    def close(self) -> None:
        if self._closed:
            return
        self._kill_all()
        if self.cg:
            self.cg.remove()
        if os.path.isdir(self.dir):  # absent when another handle closed it first
            shutil.rmtree(self.dir)
        self._closed = True

    def describe(self) -> dict:
        return {**super().describe(), "isolated": False, "host_dir": self.fs_root}


class LocalBackend(Backend):
    name = "local"

    @classmethod
    def layer_dirs(cls, manager, snap) -> list[str]:
        return [manager.store.layer_dir(lid) for lid in file_layers(snap, cls.name)[0]]

    @classmethod
    def _launch(cls, manager, sid, image, limits, origin, fill) -> LocalSandbox:
        if limits.network is False:
            raise SandboxError("local backend: cannot enforce limits.network=False (it has no network "
                               "namespace); pass Limits(network=True) or Limits.unlimited()")
        if limits.disk_bytes is not None:
            raise SandboxError("local backend: cannot enforce limits.disk_bytes; set it to None")
        layout = detect_layout()
        refuse_unenforceable(limits, layout, "local backend")
        msg = (f"k3.env: sandbox {sid} uses the 'local' backend: NOT ISOLATED - commands run on this host "
               f"as uid {os.getuid()} with full access to its files, network and processes")
        warnings.warn(msg, NotIsolatedWarning, stacklevel=3)
        print(msg, file=sys.stderr)
        state = {"id": sid, "backend": cls.name, "image": image, "layers": [], "origin": origin,
                 "limits": limits.as_dict(), "cgroup": manager.cgroup_name(sid),
                 "cgroup_layout": layout.for_limits(limits).as_dict() if layout.dirs else None, "created": time.time(),
                 "pgids": []}
        sb = LocalSandbox(manager, state)
        fill(sb.fs_root)
        os.makedirs(os.path.join(sb.fs_root, "workspace"), exist_ok=True)
        os.makedirs(os.path.join(sb.fs_root, "root"), exist_ok=True)
        if sb.cg:
            sb.cg.create(limits)
        sb._save()
        return sb

    @classmethod
    def create(cls, manager, sandbox_id, image, limits, workspace, nested=False) -> Sandbox:
        if nested:
            raise SandboxError("local backend: nested=True is refused (it isolates nothing, so it cannot isolate "
                               "a sandbox's children from it)")

        def fill(root):
            os.makedirs(root)
            if workspace:
                shutil.copytree(workspace, os.path.join(root, "workspace"), symlinks=True)
        return cls._launch(manager, sandbox_id, image, limits, None, fill)

    @classmethod
    def fork(cls, manager, snapshot, sandbox_id, limits) -> Sandbox:
        layers = cls.layer_dirs(manager, snapshot)
        return cls._launch(manager, sandbox_id, snapshot.meta["image"], limits, snapshot.id,
                           lambda root: materialize(layers, root))

    @classmethod
    def attach(cls, manager, state) -> Sandbox:
        return LocalSandbox(manager, state)
