"""Backend ``vm``: a QEMU microvm per sandbox, with full-machine snapshots (SPEC §7.1).

The guest runs from an initramfs only (``k3.env.vm_image``), so a QMP migration of the stopped VM
to a file holds everything: kernel, processes, their memory, the files in ``/workspace`` (tmpfs).

* snapshot = QMP ``stop`` + ``migrate`` to ``exec:cat > file`` + ``cont``; the file becomes a
  content-addressed blob of the manager's store (``content={"state": key}``), the record also
  keeps the ``MachineConfig`` it loads under (a stream loads only into the same machine);
* fork = a new QEMU started with ``-incoming`` from that blob (the fork's processes continue where
  the snapshot left them, the original moves on); restore = this sandbox's QEMU replaced by one
  loaded from it; pause/resume = QMP ``stop``/``cont``;
* the QEMU runs in its own session under ``manager.sandbox_dir(id)/qemu-<n>/`` and outlives the
  process that started it; ``state.json`` names its pid, so any process attaches (``k3 env exec``);
* image: only the manager's default image is accepted, and means the busybox guest (a host root
  tree is not packed into the VM); ``workspace`` is copied in as a tar stream;
* limits: ``memory_bytes`` -> cgroup ``memory.max`` in the guest (the VM gets 96 MiB more for its
  kernel and agent), ``pids`` -> ``pids.max``, ``cpus`` -> ``cpu.max`` and the vCPU count,
  ``disk_bytes`` -> the size of the ``/workspace`` tmpfs; ``network=True`` is refused (the VM has
  no network device at all).

KVM is used when a probe boot under KVM reaches the agent (cached per host kernel, QEMU and guest
kernel); otherwise TCG. ``K3_VM_ACCEL=tcg|kvm`` forces one.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import os
import platform
import shutil
import subprocess
import tarfile
import tempfile
import time
from pathlib import Path

from k3.env import vm_files
from k3.env.images import default_image
from k3.env.sandbox import Backend, ExecResult, FileEntry, Limits, Sandbox, SandboxError, SnapshotInfo
from k3.env.vm_image import build_initramfs, cache_dir, qemu_binary
from k3.env.vm_qemu import CLOCK_ARGS, MachineConfig, Qemu

OVERHEAD_MB = 96          # guest kernel + agent, on top of the sandbox's memory limit
DEFAULT_MEM_MB = 512      # VM size when Limits.memory_bytes is None
BOOT_TIMEOUT = float(os.environ.get("K3_VM_BOOT_TIMEOUT", "240"))
KVM_PROBE_TIMEOUT = 10.0     # a KVM boot reaches the agent in ~1 s where KVM works
# How snapshot files are written: "none" (default; fastest snapshot/fork) or "zstd" (~4.6x smaller
# state, ~2x the snapshot and fork time under TCG on a loaded host; docs/VM.md).
CODEC = os.environ.get("K3_VM_STATE_CODEC", "none")
AGENT_GRACE = 60.0        # host waits this long past a command's own timeout before giving up


def _check_limits(limits: Limits) -> None:
    if limits.network:
        raise SandboxError("vm backend: Limits.network=True is not implemented (the VM has no network device)")
    for name in ("memory_bytes", "pids", "disk_bytes"):
        v = getattr(limits, name)
        if v is not None and v <= 0:
            raise SandboxError(f"vm backend: Limits.{name} must be positive, got {v}")
    if limits.cpus is not None and not (0 < limits.cpus <= (os.cpu_count() or 1)):
        raise SandboxError(f"vm backend: Limits.cpus={limits.cpus} is outside (0, {os.cpu_count()}] host CPUs")


def machine_config(limits: Limits, accel: str | None = None) -> MachineConfig:
    """The QEMU machine for ``limits`` (the limits the guest enforces travel on the kernel command
    line as ``k3.mem= k3.pids= k3.cpu= k3.disk=``)."""
    _check_limits(limits)
    kernel, initrd = build_initramfs()
    mem = limits.memory_bytes
    mem_mb = DEFAULT_MEM_MB if mem is None else math.ceil(mem / 2**20) + OVERHEAD_MB
    args = ["console=ttyS0", "quiet", "panic=-1", CLOCK_ARGS]
    if mem is not None:
        args.append(f"k3.mem={mem}")
    if limits.pids is not None:
        args.append(f"k3.pids={limits.pids}")
    if limits.cpus is not None:
        args.append(f"k3.cpu={max(1000, int(limits.cpus * 100000))}")
    if limits.disk_bytes is not None:
        args.append(f"k3.disk={limits.disk_bytes}")
    smp = 1 if limits.cpus is None else max(1, math.ceil(limits.cpus))
    return MachineConfig(str(kernel), str(initrd), mem_mb, smp, accel or choose_accel(), " ".join(args))


def choose_accel() -> str:
    """``kvm`` when a probe VM boots to its agent under KVM, else ``tcg`` (result cached)."""
    forced = os.environ.get("K3_VM_ACCEL")
    if forced:
        if forced not in ("tcg", "kvm"):
            raise SandboxError(f"K3_VM_ACCEL={forced!r}: expected tcg or kvm")
        return forced
    if not os.access("/dev/kvm", os.R_OK | os.W_OK):
        return "tcg"
    kernel, initrd = build_initramfs()
    qemu_v = subprocess.run([qemu_binary(), "--version"], capture_output=True, text=True).stdout.split("\n")[0]
    key = hashlib.sha256(f"{platform.release()}|{qemu_v}|{kernel.stat().st_size}".encode()).hexdigest()[:16]
    probe = cache_dir() / f"accel-{key}.json"
    try:
        return json.loads(probe.read_text())["accel"]
    except (OSError, ValueError, KeyError):
        pass
    cfg = MachineConfig(str(kernel), str(initrd), 128, 1, "kvm", f"console=ttyS0 quiet panic=-1 {CLOCK_ARGS}")
    rundir = Path(tempfile.mkdtemp(prefix="k3-vm-probe-"))
    q = Qemu(cfg, rundir)
    try:
        q.start(KVM_PROBE_TIMEOUT)
        accel, why = "kvm", "booted"
    except SandboxError as e:
        accel, why = "tcg", f"KVM boot failed: {str(e)[:300]}"
    finally:
        q.kill()
        shutil.rmtree(rundir, ignore_errors=True)
    probe.write_text(json.dumps({"accel": accel, "why": why, "host": platform.release(), "qemu": qemu_v}))
    return accel


class VMSandbox(Sandbox):
    """One QEMU microvm (see the module docstring). Its state (``manager.write_state``) names the
    QEMU pid, the run directory of the current QEMU and the machine config, so any process can
    attach to it; ``boot_seconds`` is how long this object waited for the agent (boot or load)."""

    backend = "vm"

    def __init__(self, manager, state: dict):
        super().__init__(state["id"], Limits.from_dict(state["limits"]))
        self.manager, self.state = manager, state
        self.dir = Path(manager.sandbox_dir(self.id))
        self.config = MachineConfig(**state["config"])
        self._qemu = Qemu(self.config, self.dir / f"qemu-{state['run']}", state.get("pid"))
        self._closed = False
        self.boot_seconds = 0.0

    def _save(self) -> None:
        self.state["pid"] = self._qemu.pid
        self.manager.write_state(self.id, self.state)

    def _launch(self, incoming: Path | None = None, codec: str = "none") -> None:
        self._qemu = Qemu(self.config, self.dir / f"qemu-{self.state['run']}")
        self.boot_seconds = self._qemu.start(BOOT_TIMEOUT, incoming, codec)
        self.state["paused"] = False
        self._save()

    # ---- state checks
    @property
    def closed(self) -> bool:
        return self._closed

    def _live(self, what: str) -> Qemu:
        if self._closed:
            raise SandboxError(f"vm sandbox {self.id}: {what} after close()")
        if not self._qemu.alive():
            raise SandboxError(f"vm sandbox {self.id}: {what}: QEMU is gone ({self._qemu.log_tail()})")
        return self._qemu

    def _running(self, what: str) -> Qemu:
        q = self._live(what)
        if self.state.get("paused"):
            raise SandboxError(f"vm sandbox {self.id}: {what} while paused; resume() it first")
        return q

    # ---- processes and files
    def exec(self, cmd, timeout: float | None = 60.0, stdin: bytes | None = None,
             env: dict[str, str] | None = None, cwd: str | None = None, channel: bool = False) -> ExecResult:
        if channel:
            raise SandboxError("vm backend: exec(channel=True) is not implemented (its console carries one "
                               "command's stdout and stderr only); the namespace backend has it")
        q = self._running("exec")
        if timeout is not None and timeout <= 0:
            raise SandboxError(f"vm sandbox {self.id}: exec timeout must be positive, got {timeout}")
        wd = vm_files.guest_path(cwd, self.workdir) if cwd else self.workdir
        script = vm_files.exec_script(cmd, env, wd)
        return self._run(q, script, stdin or b"", timeout, self.limits.output_bytes)

    def _run(self, q: Qemu, script: bytes, stdin: bytes, timeout: float | None, cap: int) -> ExecResult:
        t0 = time.monotonic()
        deadline = None if timeout is None else t0 + timeout + AGENT_GRACE
        with q.agent() as ch:
            (rc, to, oom, osz, esz), out, err = ch.run(script, stdin, timeout, cap, deadline)
        return ExecResult(None if to else rc, out, err, time.monotonic() - t0, timed_out=bool(to),
                          truncated=osz > len(out) or esz > len(err), oom_killed=oom > 0)

    def _op(self, what: str, script: bytes, stdin: bytes = b"", cap: int = 1 << 20) -> ExecResult:
        r = self._run(self._running(what), script, stdin, 300.0, cap)
        if r.exit_code != 0:
            raise SandboxError(f"vm sandbox {self.id}: {what}: {r.stderr.decode(errors='replace').strip()}")
        return r

    def read_file(self, path: str, max_bytes: int | None = None) -> bytes:
        cap = (1 << 62) if max_bytes is None else max_bytes
        r = self._op(f"read_file {path!r}", vm_files.read_script(path, self.workdir), cap=cap)
        if r.truncated:
            raise SandboxError(f"vm sandbox {self.id}: read_file {path!r}: larger than max_bytes={max_bytes}")
        return r.stdout

    def write_file(self, path: str, data: bytes | str, mode: int = 0o644) -> None:
        data = data.encode() if isinstance(data, str) else bytes(data)
        self._op(f"write_file {path!r}", vm_files.write_script(path, self.workdir, mode), data)

    def list(self, path: str = ".", recursive: bool = False) -> list[FileEntry]:
        r = self._op(f"list {path!r}", vm_files.list_script(path, self.workdir, recursive), cap=1 << 26)
        return vm_files.parse_list(r.stdout)

    def _put_tree(self, src: str) -> None:
        """Copy a host directory's files into ``/workspace`` (a tar stream through the agent)."""
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            for name in sorted(os.listdir(src)):
                tar.add(os.path.join(src, name), arcname=name)
        self._op(f"workspace {src!r}", f"tar -x -C {self.workdir}\n".encode(), buf.getvalue())

    # ---- lifecycle
    def _set_paused(self, paused: bool) -> None:
        q = self._live("resume" if not paused else "pause")
        if bool(self.state.get("paused")) != paused:
            with q.qmp() as m:
                m.cmd("stop" if paused else "cont")
            self.state["paused"] = paused
            self._save()

    def pause(self) -> None:
        self._set_paused(True)

    def resume(self) -> None:
        self._set_paused(False)

    def snapshot(self) -> str:
        return self.snapshot_info().id

    def snapshot_info(self) -> SnapshotInfo:
        """``snapshot()`` with its record; ``meta['state_bytes']`` is the stored state file's size
        (after ``meta['codec']``),
        ``meta['save_seconds']`` the time the VM stood still for it."""
        q = self._live("snapshot")
        store = self.manager.store
        fd, tmp = tempfile.mkstemp(dir=os.path.join(store.root, "tmp"), prefix="vm-", suffix=".state")
        os.close(fd)
        was_paused = bool(self.state.get("paused"))
        t0 = time.monotonic()
        try:
            with q.qmp() as m:
                if not was_paused:
                    m.cmd("stop")
                try:
                    q.save(m, Path(tmp), CODEC)
                finally:
                    if not was_paused:
                        m.cmd("cont")
            stood = time.monotonic() - t0
            key, added = store.add_blob(tmp)
            size = os.path.getsize(tmp)
        finally:
            os.unlink(tmp)
        info = store.save_snapshot(self.state["image"], [], self.state.get("origin"), self.backend, added,
                                   content={"state": key},
                                   meta={"limits": self.limits.as_dict(), "config": self.state["config"],
                                         "sandbox": self.id, "state_bytes": size, "save_seconds": stood,
                                         "codec": CODEC})
        return info

    def restore(self, snapshot_id: str) -> None:
        self._live("restore")
        snap = self.manager.store.snapshot(snapshot_id)
        state = VMBackend.state_file(self.manager, snap)
        if snap.meta["config"] != self.state["config"]:
            raise SandboxError(f"vm sandbox {self.id}: snapshot {snapshot_id} is of a machine with other "
                               "limits or guest parts; fork() it instead")
        self._qemu.kill()
        shutil.rmtree(self._qemu.rundir, ignore_errors=True)
        self.state.update(run=self.state["run"] + 1, origin=snap.id)
        self._launch(state, snap.meta.get("codec", "none"))

    def fork(self, snapshot_id: str | None = None) -> Sandbox:
        self._live("fork")
        return self.manager.fork(snapshot_id or self.snapshot(), backend=self.backend)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._qemu.kill()
        shutil.rmtree(self.dir, ignore_errors=True)

    def describe(self) -> dict:
        return {**super().describe(), "accel": self.config.accel, "mem_mb": self.config.mem_mb,
                "paused": bool(self.state.get("paused")), "origin": self.state.get("origin")}


class VMBackend(Backend):
    """The manager's entry points for ``backend="vm"`` (protocol in ``k3.env.sandbox``)."""

    name = "vm"

    @staticmethod
    def state_file(manager, snap: SnapshotInfo) -> Path:
        if snap.backend != "vm" or "state" not in snap.meta.get("content", {}):
            raise SandboxError(f"snapshot {snap.id} is a {snap.backend!r} snapshot: the vm backend starts "
                               "only from vm snapshots (a memory image)")
        cfg = snap.meta["config"]
        for part in (cfg["kernel"], cfg["initrd"]):
            if not os.path.isfile(part):
                raise SandboxError(f"vm snapshot {snap.id} needs {part}, which is gone; run `make vm-deps`")
        return Path(manager.store.blob_path(snap.meta["content"]["state"]))

    @classmethod
    def _new(cls, manager, sid, image, limits, config, origin) -> VMSandbox:
        state = {"id": sid, "backend": cls.name, "image": image, "limits": limits.as_dict(),
                 "config": config.__dict__, "run": 0, "origin": origin, "created": time.time(), "layers": []}
        return VMSandbox(manager, state)

    @classmethod
    def create(cls, manager, sandbox_id, image, limits, workspace, nested=False) -> Sandbox:
        if nested:
            raise SandboxError("vm backend: nested=True is not implemented (its busybox guest has no Python for a "
                               "verifier); use the namespace backend")
        if image != default_image(manager.store):
            raise SandboxError(f"vm backend: image {image}: the vm runs its own busybox guest "
                               "(k3.env.vm_image); only image='default' is accepted")
        sb = cls._new(manager, sandbox_id, image, limits, machine_config(limits), None)
        try:
            sb._launch()
            if workspace:
                sb._put_tree(workspace)
        except BaseException:
            sb.close()
            raise
        return sb

    @classmethod
    def fork(cls, manager, snapshot, sandbox_id, limits) -> Sandbox:
        state = cls.state_file(manager, snapshot)
        if limits.as_dict() != snapshot.meta["limits"]:
            raise SandboxError(f"vm backend: a fork keeps the snapshot's machine; limits {limits} differ from "
                               f"the snapshot's {snapshot.meta['limits']}")
        sb = cls._new(manager, sandbox_id, snapshot.meta["image"], limits,
                      MachineConfig(**snapshot.meta["config"]), snapshot.id)
        try:
            sb._launch(state, snapshot.meta.get("codec", "none"))
        except BaseException:
            sb.close()
            raise
        return sb

    @classmethod
    def attach(cls, manager, state) -> Sandbox:
        return VMSandbox(manager, state)

    @staticmethod
    def alive(manager, state) -> bool:
        q = Qemu(MachineConfig(**state["config"]), Path(manager.sandbox_dir(state["id"])) / f"qemu-{state['run']}",
                 state.get("pid"))
        return q.alive()
