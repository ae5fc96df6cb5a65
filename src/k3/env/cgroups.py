"""Per-sandbox cgroups on cgroup v2, v1 or the hybrid of both, detected at runtime.

A sandbox's group is one directory per hierarchy it uses, all named ``k3-<tag>-<sandbox id>``
under a ``k3env`` parent. What each limit needs:

=============  ===============================  =====================================
limit          cgroup v2 (unified)              cgroup v1
=============  ===============================  =====================================
memory_bytes   ``memory.max`` (+ swap.max = 0)   ``memory.limit_in_bytes`` (+ memsw)
pids           ``pids.max``                     ``pids.max``
cpus           ``cpu.max`` (quota period)       ``cpu.cfs_quota_us`` / ``cfs_period_us``
pause          ``cgroup.freeze``                ``freezer.state``
kill           ``cgroup.kill``                  SIGKILL every pid in ``cgroup.procs``
=============  ===============================  =====================================

A v2 hierarchy is used for a controller only when the controller is enabled in the ``k3env``
parent's ``cgroup.subtree_control``; otherwise its v1 hierarchy, if mounted. A limit no hierarchy
can enforce is refused (``SandboxError`` naming the limit), never dropped.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass, field

from k3.env.sandbox import Limits, SandboxError

__all__ = ["CgroupLayout", "Cgroup", "detect_layout", "refuse_unenforceable"]

PARENT = "k3env"
CONTROLLERS = ("memory", "pids", "cpu", "freezer")
_LIMIT_CONTROLLER = {"memory_bytes": "memory", "pids": "pids", "cpus": "cpu"}


@dataclass
class CgroupLayout:
    """Where each controller lives: ``dirs[c]`` = the ``k3env`` parent directory serving
    controller ``c`` (``"freezer"`` = pause, ``"kill"`` = cgroup.kill); ``v2`` = those that are
    cgroup v2 directories; ``all_dirs`` = every parent a sandbox group is made in."""

    dirs: dict[str, str] = field(default_factory=dict)
    v2: set[str] = field(default_factory=set)

    @property
    def all_dirs(self) -> list[str]:
        return sorted(set(self.dirs.values()))

    def supports(self, controller: str) -> bool:
        return controller in self.dirs

    def for_limits(self, limits: Limits) -> "CgroupLayout":
        """The hierarchies a sandbox with ``limits`` joins. A v1 ``cpu`` hierarchy is left out
        when no CPU limit is set: a group of its own there would make the whole sandbox one
        scheduling entity (one task's share of the CPU under load), not a limit anyone asked for."""
        if limits.cpus is None and "cpu" in self.dirs and "cpu" not in self.v2:
            return CgroupLayout({k: v for k, v in self.dirs.items() if k != "cpu"}, set(self.v2))
        return CgroupLayout(dict(self.dirs), set(self.v2))

    def as_dict(self) -> dict:
        return {"dirs": dict(self.dirs), "v2": sorted(self.v2)}

    @classmethod
    def from_dict(cls, d: dict) -> "CgroupLayout":
        return cls(dict(d["dirs"]), set(d["v2"]))


def _mounts() -> list[tuple[str, str, set[str]]]:
    """(mount point, fstype, super options) of every cgroup/cgroup2 mount of this process."""
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, right = line.split(" - ", 1)
            fstype, _src, sopts = (right.split() + ["", ""])[:3]
            if fstype in ("cgroup", "cgroup2"):
                out.append((left.split()[4], fstype, set(sopts.split(","))))
    return out


def _own_paths() -> dict[str, str]:
    """This process's cgroup path per v1 controller name, and ``""`` for the v2 hierarchy."""
    paths = {}
    with open("/proc/self/cgroup") as f:
        for line in f:
            _hid, names, path = line.rstrip("\n").split(":", 2)
            for n in (names.split(",") if names else [""]):
                paths[n] = path
    return paths


def _write(path: str, text: str) -> bool:
    try:
        with open(path, "w") as f:
            f.write(text)
        return True
    except OSError:
        return False


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


_layout: CgroupLayout | None = None


def detect_layout() -> CgroupLayout:
    """Find (and create) the ``k3env`` parents; cached for the process."""
    global _layout
    if _layout is not None:
        return _layout
    lay = CgroupLayout()
    own = _own_paths()
    for mnt, fstype, opts in _mounts():
        if fstype == "cgroup2":
            base = os.path.join(mnt, own.get("", "/").lstrip("/"))
            if mnt == "/sys/fs/cgroup" or not os.path.exists(os.path.join(mnt, "cgroup.controllers")):
                base = mnt  # a pure v2 machine: the parent goes under the namespace root
            parent = os.path.join(base, PARENT)
            try:
                os.makedirs(parent, exist_ok=True)
            except OSError:
                continue
            avail = set(_read(os.path.join(mnt, "cgroup.controllers")).split())
            for c in ("memory", "pids", "cpu"):
                if c in avail:
                    _write(os.path.join(base, "cgroup.subtree_control"), f"+{c}")
                    _write(os.path.join(parent, "cgroup.subtree_control"), f"+{c}")
            enabled = set(_read(os.path.join(parent, "cgroup.subtree_control")).split())
            for c in enabled & {"memory", "pids", "cpu"}:
                lay.dirs[c] = parent
                lay.v2.add(c)
            lay.dirs["freezer"] = parent
            lay.dirs["kill"] = parent
            lay.v2 |= {"freezer", "kill"}
    for mnt, fstype, opts in _mounts():
        if fstype != "cgroup":
            continue
        for c in CONTROLLERS:
            if c in opts and c not in lay.dirs:
                parent = os.path.join(mnt, own.get(c, "/").lstrip("/"), PARENT)
                try:
                    os.makedirs(parent, exist_ok=True)
                except OSError:
                    continue
                lay.dirs[c] = parent
    _layout = lay
    return lay


def refuse_unenforceable(limits: Limits, layout: CgroupLayout, where: str) -> None:
    """Raise ``SandboxError`` naming every set limit no controller here can enforce."""
    missing = [name for name, c in _LIMIT_CONTROLLER.items()
               if getattr(limits, name) is not None and not layout.supports(c)]
    if missing:
        raise SandboxError(f"{where}: cannot enforce limits.{', limits.'.join(missing)} on this machine "
                           f"(no cgroup controller for it: have {sorted(layout.dirs)}); set it to None")


class Cgroup:
    """One sandbox's group across the hierarchies of ``layout``."""

    def __init__(self, name: str, layout: CgroupLayout | None = None):
        self.name = name
        self.layout = layout or detect_layout()

    def path(self, controller: str) -> str:
        return os.path.join(self.layout.dirs[controller], self.name)

    @property
    def dirs(self) -> list[str]:
        return [os.path.join(d, self.name) for d in self.layout.all_dirs]

    @property
    def procs_files(self) -> list[str]:
        return [os.path.join(d, "cgroup.procs") for d in self.dirs]

    def create(self, limits: Limits) -> None:
        for d in self.dirs:
            os.makedirs(d, exist_ok=True)
        try:
            self._apply(limits)
        except OSError as e:
            self.remove()
            raise SandboxError(f"cgroup {self.name}: cannot set a limit: {e}") from e

    def _apply(self, lim: Limits) -> None:
        def put(c, fname, value):
            with open(os.path.join(self.path(c), fname), "w") as f:
                f.write(str(value))

        if lim.memory_bytes is not None:
            if "memory" in self.layout.v2:
                put("memory", "memory.max", lim.memory_bytes)
                if os.path.exists(os.path.join(self.path("memory"), "memory.swap.max")):
                    put("memory", "memory.swap.max", 0)
            else:
                put("memory", "memory.limit_in_bytes", lim.memory_bytes)
                if os.path.exists(os.path.join(self.path("memory"), "memory.memsw.limit_in_bytes")):
                    put("memory", "memory.memsw.limit_in_bytes", lim.memory_bytes)
        if lim.pids is not None:
            put("pids", "pids.max", lim.pids)
        if lim.cpus is not None:
            period = 100_000
            quota = max(1000, int(lim.cpus * period))
            if "cpu" in self.layout.v2:
                put("cpu", "cpu.max", f"{quota} {period}")
            else:
                put("cpu", "cpu.cfs_period_us", period)
                put("cpu", "cpu.cfs_quota_us", quota)

    def join_self(self) -> None:
        """Move the calling process into the group (used in a child before exec)."""
        for p in self.procs_files:
            with open(p, "w") as f:
                f.write("0")

    def pids(self) -> set[int]:
        out: set[int] = set()
        for p in self.procs_files:
            try:
                out |= {int(x) for x in _read(p).split()}
            except OSError:
                pass
        return out

    def oom_kills(self) -> int:
        """How many processes the memory limit has killed so far."""
        if not self.layout.supports("memory"):
            return 0
        fname = "memory.events" if "memory" in self.layout.v2 else "memory.oom_control"
        try:
            for line in _read(os.path.join(self.path("memory"), fname)).splitlines():
                k, _, v = line.partition(" ")
                if k == "oom_kill":
                    return int(v)
        except OSError:
            pass
        return 0

    def set_frozen(self, frozen: bool, timeout: float = 5.0) -> None:
        if not self.layout.supports("freezer"):
            raise SandboxError(f"cgroup {self.name}: no freezer on this machine; pause is impossible")
        d = self.path("freezer")
        if "freezer" in self.layout.v2:
            _write(os.path.join(d, "cgroup.freeze"), "1" if frozen else "0")
            want, probe = f"frozen {int(frozen)}", lambda: _read(os.path.join(d, "cgroup.events"))
        else:
            _write(os.path.join(d, "freezer.state"), "FROZEN" if frozen else "THAWED")
            want, probe = "FROZEN" if frozen else "THAWED", lambda: _read(os.path.join(d, "freezer.state"))
        end = time.monotonic() + timeout
        while want not in probe():
            if time.monotonic() > end:
                raise SandboxError(f"cgroup {self.name}: did not become {'frozen' if frozen else 'thawed'} "
                                   f"within {timeout} s")
            time.sleep(0.002)

    def kill_all(self, timeout: float = 10.0) -> None:
        """SIGKILL every process in the group and wait until it is empty."""
        kill_file = os.path.join(self.path("kill"), "cgroup.kill") if self.layout.supports("kill") else ""
        end = time.monotonic() + timeout
        while True:
            pids = self.pids()
            if not pids:
                return
            if kill_file and os.path.exists(kill_file):
                _write(kill_file, "1")
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            if self.layout.supports("freezer") and "freezer" not in self.layout.v2:
                _write(os.path.join(self.path("freezer"), "freezer.state"), "THAWED")
            if time.monotonic() > end:
                raise SandboxError(f"cgroup {self.name}: processes {sorted(pids)} survived SIGKILL")
            time.sleep(0.005)

    def remove(self, timeout: float = 5.0) -> None:
        end = time.monotonic() + timeout
        for d in self.dirs:
            while os.path.isdir(d):
                try:
                    os.rmdir(d)
                except OSError:
                    if time.monotonic() > end:
                        raise SandboxError(f"cgroup {d}: cannot remove (still busy)")
                    time.sleep(0.01)
