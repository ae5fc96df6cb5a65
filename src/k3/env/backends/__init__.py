"""Backend registry: name -> ``"module:Class"``, imported on first use.

A backend class implements the protocol in ``k3.env.sandbox`` (``Backend``): ``create``,
``fork`` and ``attach`` classmethods returning a ``Sandbox``. The ``vm`` backend's module is
``k3.env.backends.vm``; a name is never replaced by another backend when its import fails.
"""

from __future__ import annotations

import importlib

from k3.env.sandbox import SandboxError

__all__ = ["BACKENDS", "get_backend", "backend_names"]

BACKENDS: dict[str, str] = {
    "namespace": "k3.env.backends.namespace:NamespaceBackend",
    "local": "k3.env.backends.local:LocalBackend",
    "vm": "k3.env.backends.vm:VMBackend",
}


def backend_names() -> list[str]:
    return sorted(BACKENDS)


def get_backend(name: str):
    """The backend class registered as ``name`` (``SandboxError`` for an unknown name or a
    backend whose module cannot be imported: the message names it and the cause)."""
    if name not in BACKENDS:
        raise SandboxError(f"unknown sandbox backend {name!r}; known: {', '.join(backend_names())}")
    mod, cls = BACKENDS[name].split(":")
    try:
        return getattr(importlib.import_module(mod), cls)
    except (ImportError, AttributeError) as e:
        raise SandboxError(f"sandbox backend {name!r} ({BACKENDS[name]}) is not available: {e}") from e
