"""Sandboxes for agents (SPEC §7.1): one ``Sandbox`` interface, backends ``namespace`` (default on
Linux), ``vm`` (QEMU, keeps process memory) and ``local`` (no isolation, never chosen implicitly),
driven by a ``SandboxManager`` that persists sandboxes and content-addressed snapshots."""

from k3.env.manager import SandboxManager
from k3.env.sandbox import Backend, ExecResult, FileEntry, Limits, Sandbox, SandboxError, SnapshotInfo

__all__ = ["Backend", "ExecResult", "FileEntry", "Limits", "Sandbox", "SandboxError", "SandboxManager",
           "SnapshotInfo"]
