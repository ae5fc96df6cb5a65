"""Sandboxes for agents (SPEC §7.1): one ``Sandbox`` interface, backends ``namespace`` (default on
Linux), ``vm`` (QEMU, keeps process memory) and ``local`` (no isolation, never chosen implicitly)."""

from k3.env.sandbox import ExecResult, Limits, Sandbox, SandboxError

__all__ = ["ExecResult", "Limits", "Sandbox", "SandboxError"]
