"""k3's error types: every user-facing problem is a ``K3Error`` whose message names the field or path.

``K3Error`` subclasses ``ValueError`` so existing ``except ValueError`` callers keep working; the CLI
turns any ``K3Error`` (and OS errors) into one line on stderr and exit code 2.
"""

from __future__ import annotations

__all__ = ["K3Error", "ConfigError", "CheckpointError"]


class K3Error(ValueError):
    """Base of every error k3 raises for bad input, a bad file or a refused operation."""


class ConfigError(K3Error):
    """A model, run or CLI configuration that is malformed; the message names the field."""


class CheckpointError(K3Error):
    """A checkpoint that cannot be read or does not match the model; the message names the file."""
