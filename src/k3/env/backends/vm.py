"""Backend ``vm``: a QEMU microvm per sandbox, with full-machine snapshots (SPEC §7.1).

The guest runs from an initramfs only (``k3.env.vm_image``), so a QMP migration of the stopped VM
to a file holds everything: kernel, processes, their memory, the files in ``/workspace`` (tmpfs).

* snapshot = QMP ``stop`` + ``migrate`` to ``exec:cat > file`` + ``cont``; id = sha256 of the file;
* fork = a new QEMU started with ``-incoming`` from that file (the fork's processes continue where
  the snapshot left them, the original moves on); restore = this sandbox's QEMU replaced by one
  loaded from the file; pause/resume = QMP ``stop``/``cont``;
* limits: ``memory_bytes`` -> cgroup ``memory.max`` in the guest (the VM gets 96 MiB more for its
  kernel and agent), ``pids`` -> ``pids.max``, ``cpus`` -> ``cpu.max`` and the vCPU count,
  ``disk_bytes`` -> the size of the ``/workspace`` tmpfs; ``network=True`` is refused (the VM has
  no network device at all).

KVM is used when a probe boot under KVM reaches the agent (cached per host kernel, QEMU and guest
kernel); otherwise TCG. ``K3_VM_ACCEL=tcg|kvm`` forces one.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from k3.env import vm_files
from k3.env.sandbox import ExecResult, FileEntry, Limits, Sandbox, SandboxError, SnapshotInfo
from k3.env.vm_image import build_initramfs, cache_dir, qemu_binary
from k3.env.vm_qemu import CLOCK_ARGS, MachineConfig, Qemu

OVERHEAD_MB = 96          # guest kernel + agent, on top of the sandbox's memory limit
DEFAULT_MEM_MB = 512      # VM size when Limits.memory_bytes is None
BOOT_TIMEOUT = float(os.environ.get("K3_VM_BOOT_TIMEOUT", "240"))
KVM_PROBE_TIMEOUT = 10.0     # a KVM boot reaches the agent in ~1 s where KVM works
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


class SnapshotStore:
    """Content-addressed VM states: ``<root>/<id>.state`` (the migration stream) and
    ``<root>/<id>.json`` (a ``SnapshotInfo`` plus the ``MachineConfig`` it loads under)."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    def put(self, tmp: Path, config: MachineConfig, limits: Limits, parent: str | None) -> SnapshotInfo:
        h = hashlib.sha256()
        with open(tmp, "rb") as f:
            while chunk := f.read(1 << 22):
                h.update(chunk)
        sid = h.hexdigest()
        size = tmp.stat().st_size
        dest = self.root / f"{sid}.state"
        if dest.exists():
            tmp.unlink()
            added = 0
        else:
            os.replace(tmp, dest)
            added = size
        info = SnapshotInfo(sid, "vm", parent, time.time(), added,
                            {"config": config.__dict__, "limits": limits.as_dict(), "state_bytes": size})
        meta = self.root / f"{sid}.json"
        meta.write_text(json.dumps(info.__dict__))
        return info

    def get(self, sid: str) -> tuple[SnapshotInfo, Path]:
        if not isinstance(sid, str) or len(sid) != 64 or any(c not in "0123456789abcdef" for c in sid):
            raise SandboxError(f"vm: unknown snapshot id {sid!r} (not a sha256 id)")
        meta, state = self.root / f"{sid}.json", self.root / f"{sid}.state"
        if not (meta.is_file() and state.is_file()):
            raise SandboxError(f"vm: unknown snapshot id {sid} (not in {self.root})")
        return SnapshotInfo(**json.loads(meta.read_text())), state

    def list(self) -> list[SnapshotInfo]:
        return sorted((self.get(p.stem)[0] for p in self.root.glob("*.json")), key=lambda i: i.created)

    def remove(self, sid: str) -> None:
        self.get(sid)
        for ext in (".state", ".json"):
            (self.root / f"{sid}{ext}").unlink(missing_ok=True)


def default_store() -> Path:
    return Path(os.environ.get("K3_VM_STORE", cache_dir() / "snapshots"))


class VMSandbox(Sandbox):
    """One QEMU microvm (see the module docstring). ``boot_seconds`` is how long it took to
    reach the agent (a boot, or a load from a snapshot)."""

    backend = "vm"

    def __init__(self, sandbox_id: str | None = None, limits: Limits | None = None,
                 store: Path | str | None = None, *, _from: str | None = None):
        limits = limits or Limits()
        super().__init__(sandbox_id or "vm-" + os.urandom(6).hex(), limits)
        self.store = SnapshotStore(Path(store) if store is not None else default_store())
        self._rundir = Path(tempfile.mkdtemp(prefix=f"k3-{self.id}-"))
        self._closed, self._paused = False, False
        self.parent: str | None = None
        try:
            if _from is None:
                self.config = machine_config(limits)
                self._qemu = Qemu(self.config, self._rundir / "0")
                self.boot_seconds = self._qemu.start(BOOT_TIMEOUT)
            else:
                self._qemu = None
                self.boot_seconds = self._load(_from)
        except BaseException:
            self._closed = True
            shutil.rmtree(self._rundir, ignore_errors=True)
            raise

    @classmethod
    def from_snapshot(cls, snapshot_id: str, store: Path | str | None = None,
                      sandbox_id: str | None = None) -> "VMSandbox":
        """A new sandbox whose machine continues from ``snapshot_id`` (processes included)."""
        st = SnapshotStore(Path(store) if store is not None else default_store())
        info, _ = st.get(snapshot_id)
        return cls(sandbox_id, Limits(**info.meta["limits"]), st.root, _from=snapshot_id)

    def _load(self, snapshot_id: str) -> float:
        info, state = self.store.get(snapshot_id)
        config = MachineConfig(**info.meta["config"])
        for part in (config.kernel, config.initrd):
            if not Path(part).is_file():
                raise SandboxError(f"vm: snapshot {snapshot_id} needs {part}, which is gone; run `make vm-deps`")
        if self._qemu is not None:
            self._qemu.kill()
        n = len(list(self._rundir.iterdir()))
        self.config = config
        self._qemu = Qemu(config, self._rundir / str(n))
        self._paused, self.parent = False, snapshot_id
        return self._qemu.start(BOOT_TIMEOUT, incoming=state)

    # ---- state checks
    @property
    def closed(self) -> bool:
        return self._closed

    def _live(self, what: str) -> Qemu:
        if self._closed:
            raise SandboxError(f"vm sandbox {self.id}: {what} after close()")
        if not self._qemu.alive():
            raise SandboxError(f"vm sandbox {self.id}: QEMU is gone ({self._qemu.log_tail()})")
        return self._qemu

    def _running(self, what: str) -> Qemu:
        q = self._live(what)
        if self._paused:
            raise SandboxError(f"vm sandbox {self.id}: {what} while paused (resume() first)")
        return q

    # ---- processes and files
    def exec(self, cmd, timeout: float | None = 60.0, stdin: bytes | None = None,
             env: dict[str, str] | None = None, cwd: str | None = None) -> ExecResult:
        q = self._running("exec")
        script = vm_files.exec_script(cmd, env, cwd or self.workdir)
        return self._run(q, script, stdin or b"", timeout, self.limits.output_bytes)

    def _run(self, q: Qemu, script: bytes, stdin: bytes, timeout: float | None, cap: int) -> ExecResult:
        t0 = time.monotonic()
        deadline = None if timeout is None else t0 + timeout + AGENT_GRACE
        (rc, to, oom, osz, esz), out, err = q.chan.run(script, stdin, timeout, cap, deadline)
        return ExecResult(None if to else rc, out, err, time.monotonic() - t0, timed_out=bool(to),
                          truncated=osz > len(out) or esz > len(err), oom_killed=oom > 0)

    def _op(self, what: str, script: bytes, stdin: bytes = b"", cap: int = 1 << 20) -> ExecResult:
        q = self._running(what)
        r = self._run(q, script, stdin, 120.0, cap)
        if r.exit_code != 0:
            raise SandboxError(f"vm sandbox {self.id}: {what}: {r.stderr.decode(errors='replace').strip()}")
        return r

    def read_file(self, path: str, max_bytes: int | None = None) -> bytes:
        cap = (1 << 62) if max_bytes is None else max_bytes
        return self._op(f"read_file {path!r}", vm_files.read_script(path, self.workdir), cap=cap).stdout

    def write_file(self, path: str, data: bytes | str, mode: int = 0o644) -> None:
        data = data.encode() if isinstance(data, str) else bytes(data)
        self._op(f"write_file {path!r}", vm_files.write_script(path, self.workdir, mode), data)

    def list(self, path: str = ".", recursive: bool = False) -> list[FileEntry]:
        r = self._op(f"list {path!r}", vm_files.list_script(path, self.workdir, recursive), cap=1 << 26)
        return vm_files.parse_list(r.stdout)

    # ---- lifecycle
    def pause(self) -> None:
        q = self._live("pause")
        if not self._paused:
            q.qmp.cmd("stop")
            self._paused = True

    def resume(self) -> None:
        q = self._live("resume")
        if self._paused:
            q.qmp.cmd("cont")
            self._paused = False

    def snapshot(self) -> str:
        return self.snapshot_info().id

    def snapshot_info(self) -> SnapshotInfo:
        """Like ``snapshot()`` with the stored record (``meta['state_bytes']``: stream size)."""
        q = self._live("snapshot")
        was_paused = self._paused
        tmp = self.store.root / f".tmp-{self.id}-{os.urandom(4).hex()}.state"
        if not was_paused:
            q.qmp.cmd("stop")
        try:
            q.save(tmp)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        finally:
            if not was_paused:
                q.qmp.cmd("cont")
        info = self.store.put(tmp, self.config, self.limits, self.parent)
        self.parent = info.id
        return info

    def restore(self, snapshot_id: str) -> None:
        self._live("restore")
        info, _ = self.store.get(snapshot_id)
        if MachineConfig(**info.meta["config"]) != self.config:
            raise SandboxError(f"vm sandbox {self.id}: snapshot {snapshot_id} was taken of a machine with "
                               "other limits or guest parts; fork() it instead")
        self._load(snapshot_id)

    def fork(self, snapshot_id: str | None = None) -> "VMSandbox":
        self._live("fork")
        sid = snapshot_id or self.snapshot()
        return VMSandbox.from_snapshot(sid, self.store.root)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._qemu is not None:
            self._qemu.kill()
        shutil.rmtree(self._rundir, ignore_errors=True)

    def describe(self) -> dict:
        d = super().describe()
        d.update(accel=self.config.accel, mem_mb=self.config.mem_mb, paused=self._paused, parent=self.parent)
        return d
