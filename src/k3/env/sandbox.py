"""The ``Sandbox`` interface every backend implements (SPEC §7.1).

Task verifiers, the agent harness and RL rollouts program against this class only; a backend is
chosen by name (``namespace`` | ``vm`` | ``local``) through ``SandboxManager`` and never silently
swapped for another. Paths given to the file methods are relative to the sandbox's workspace
(``Sandbox.workdir`` inside the sandbox, ``/workspace`` by default) or absolute inside the sandbox;
they are resolved inside the sandbox, so a symlink can never lead a read or write to a host file.

Backend protocol (``Backend`` below; registry in ``k3.env.backends``: name -> "module:Class"). The
``SandboxManager`` (``k3.env.manager``) owns a root directory and calls three classmethods:

* ``create(manager, sandbox_id, image, limits, workspace) -> Sandbox``: ``image`` is an image id
  (a layer id of ``manager.store``, resolved from "default" by the manager); ``workspace`` is
  ``None`` or a host directory whose files appear under ``/workspace``.
* ``fork(manager, snapshot, sandbox_id, limits) -> Sandbox``: ``snapshot`` is a ``SnapshotInfo``
  of ``manager.store``; the new sandbox starts from it without copying it.
* ``attach(manager, state) -> Sandbox``: re-open a live sandbox from its ``state`` dict (what the
  backend wrote with ``manager.write_state``), e.g. in a new process (``k3 env exec ID ...``).

Per sandbox, a backend may use ``manager.sandbox_dir(id)`` (removed by ``close``) and must name
its cgroups ``manager.cgroup_name(id)`` (``k3-<tag>-<id>``). Snapshots go to ``manager.store``
(``k3.env.store.Store``): file trees as content-addressed layers (``commit_layer``), other
content (e.g. a VM memory image) as content-addressed blobs (``add_blob``), recorded with
``save_snapshot(image, layers, parent, backend, nbytes, content=..., meta=...)`` whose id is the
sha256 of {image, layers, parent, backend, content}. A backend refuses (``SandboxError``) a
snapshot it cannot start from (e.g. a VM memory snapshot in the namespace backend).
"""

from __future__ import annotations

import abc
from dataclasses import asdict, dataclass, field

from k3.errors import K3Error

__all__ = ["Backend", "ExecResult", "FileEntry", "Limits", "Sandbox", "SandboxError", "SnapshotInfo"]


class SandboxError(K3Error):
    """A refused or failed sandbox operation (unknown snapshot, exec after close, a limit the
    backend cannot enforce, ...); the message names the sandbox, snapshot or limit."""


@dataclass(frozen=True)
class Limits:
    """Resource limits of one sandbox. ``None`` = no limit. A backend that cannot enforce a limit
    that is set refuses to create the sandbox (``SandboxError`` naming the limit)."""

    memory_bytes: int | None = 512 * 2**20
    pids: int | None = 256
    cpus: float | None = None          # CPU bandwidth in cores (cgroup cpu.max)
    network: bool = False              # False: an empty network namespace (no interfaces but lo)
    disk_bytes: int | None = None      # size cap of the writable layer
    output_bytes: int = 1 << 20        # per stream cap of ExecResult.stdout/stderr (truncated, flagged)

    def as_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def unlimited(cls, **overrides) -> "Limits":
        """No memory/pids/cpu/disk limit and the host network (e.g. for the ``local`` backend)."""
        return cls(**{"memory_bytes": None, "pids": None, "cpus": None, "network": True,
                      "disk_bytes": None, **overrides})

    @classmethod
    def from_dict(cls, d: dict) -> "Limits":
        unknown = set(d) - set(cls.__dataclass_fields__)
        if unknown:
            raise SandboxError(f"limits: unknown field(s) {sorted(unknown)}")
        return cls(**d)

    def __post_init__(self):
        for name in ("memory_bytes", "pids", "disk_bytes"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v <= 0):
                raise SandboxError(f"limits.{name} must be a positive int or None, got {v!r}")
        if self.cpus is not None and (isinstance(self.cpus, bool) or not isinstance(self.cpus, (int, float))
                                      or not self.cpus > 0):
            raise SandboxError(f"limits.cpus must be a positive number or None, got {self.cpus!r}")
        if isinstance(self.output_bytes, bool) or not isinstance(self.output_bytes, int) or self.output_bytes < 0:
            raise SandboxError(f"limits.output_bytes must be an int >= 0, got {self.output_bytes!r}")
        if not isinstance(self.network, bool):
            raise SandboxError(f"limits.network must be a bool, got {self.network!r}")


@dataclass
class ExecResult:
    exit_code: int | None              # None when killed by timeout before it exited
    stdout: bytes
    stderr: bytes
    elapsed: float                     # seconds, wall clock
    timed_out: bool = False
    truncated: bool = False            # stdout or stderr was cut at Limits.output_bytes
    oom_killed: bool = False           # the sandbox's memory limit killed a process
    channel: bytes | None = None       # what the command wrote on fd 3 (exec(channel=True)), capped as stdout

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out

    def text(self) -> str:
        return self.stdout.decode("utf-8", "replace")


@dataclass(frozen=True)
class FileEntry:
    path: str                          # relative to the listed directory
    kind: str                          # "file" | "dir" | "symlink" | "other"
    size: int = 0


class Sandbox(abc.ABC):
    """One isolated environment. Use as a context manager; ``close()`` kills every process in it
    and removes its mounts, cgroups and writable layer (snapshots stay in the manager's store)."""

    backend: str = "?"
    workdir: str = "/workspace"

    def __init__(self, sandbox_id: str, limits: Limits):
        self.id = sandbox_id
        self.limits = limits

    # processes
    @abc.abstractmethod
    def exec(self, cmd: str | list[str], timeout: float | None = 60.0, stdin: bytes | None = None,
             env: dict[str, str] | None = None, cwd: str | None = None, channel: bool = False) -> ExecResult:
        """Run ``cmd`` (a list = argv; a string = ``/bin/sh -c``) inside; on timeout the whole
        process group is killed and ``timed_out`` set. ``channel``: the command gets fd 3, the
        write end of a pipe to the caller opened before it starts; what it writes there comes
        back as ``ExecResult.channel`` (the verdict channel of k3.tasks.verify). A backend without
        it refuses ``channel=True``."""

    # files (inside the sandbox's view; never follows a link out of it)
    @abc.abstractmethod
    def read_file(self, path: str, max_bytes: int | None = None) -> bytes: ...

    @abc.abstractmethod
    def write_file(self, path: str, data: bytes | str, mode: int = 0o644) -> None: ...

    @abc.abstractmethod
    def list(self, path: str = ".", recursive: bool = False) -> list[FileEntry]: ...

    # lifecycle
    @abc.abstractmethod
    def pause(self) -> None:
        """Stop every process in the sandbox (cgroup freeze / VM stop) until ``resume()``."""

    @abc.abstractmethod
    def resume(self) -> None: ...

    @abc.abstractmethod
    def snapshot(self) -> str:
        """Persist the sandbox's state; returns a content-addressed snapshot id."""

    @abc.abstractmethod
    def restore(self, snapshot_id: str) -> None:
        """Roll this sandbox back to ``snapshot_id`` (one of its own or of its lineage)."""

    @abc.abstractmethod
    def fork(self, snapshot_id: str | None = None) -> "Sandbox":
        """A new sandbox starting from ``snapshot_id`` (default: a fresh snapshot of this one)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Idempotent. After it, every method but ``close`` raises ``SandboxError``."""

    @property
    @abc.abstractmethod
    def closed(self) -> bool: ...

    def __enter__(self) -> "Sandbox":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def describe(self) -> dict:
        return {"id": self.id, "backend": self.backend, "limits": self.limits.as_dict(),
                "workdir": self.workdir, "closed": self.closed}


@dataclass
class SnapshotInfo:
    id: str                            # content hash (sha256 hex of the manifest)
    backend: str
    parent: str | None                 # the snapshot this one's layers build on
    created: float
    bytes: int                         # bytes this snapshot added to the store
    meta: dict = field(default_factory=dict)


class Backend(abc.ABC):
    """What ``SandboxManager`` calls on a backend class (see the module docstring)."""

    name: str = "?"

    @classmethod
    @abc.abstractmethod
    def create(cls, manager, sandbox_id: str, image: str, limits: Limits,
               workspace: str | None, nested: bool = False) -> Sandbox: ...

    @classmethod
    @abc.abstractmethod
    def fork(cls, manager, snapshot: SnapshotInfo, sandbox_id: str, limits: Limits) -> Sandbox: ...

    @classmethod
    @abc.abstractmethod
    def attach(cls, manager, state: dict) -> Sandbox: ...
