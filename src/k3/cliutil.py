"""One place that turns errors into the CLI's one-line messages (exit 2) instead of tracebacks.

Every ``k3`` subcommand runs under :func:`guarded`: a :class:`k3.errors.K3Error`, an ``OSError``
(missing path, a file where a directory is expected, read-only filesystem, no space left) or a
torch/safetensors I/O failure becomes ``k3 CMD: error: <path>: <cause>`` on stderr and exit code 2.
``--debug`` (anywhere on the command line) or ``K3_DEBUG=1`` re-raises so the traceback shows.
Ctrl-C outside a training loop exits 130 without a traceback; so does SIGTERM inside
:func:`sigterm_interrupts` (exit 143), so that a command's cleanup runs where the default action
would kill it mid-way.
"""

from __future__ import annotations

import errno
import os
import sys
from typing import Callable

from k3.errors import K3Error

__all__ = ["guarded", "describe_error", "pop_debug_flag", "debug_enabled", "exit_quietly_on_signals",
           "leave_now_if_stopping", "sigterm_interrupts"]

_ERRNO_TEXT = {
    errno.ENOENT: "no such file or directory",
    errno.ENOTDIR: "not a directory (a file is in the way)",
    errno.EISDIR: "is a directory (expected a file)",
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
    errno.EROFS: "read-only filesystem",
    errno.ENOSPC: "no space left on device",
    errno.EDQUOT: "disk quota exceeded",
    errno.EEXIST: "already exists",
    errno.ENOTEMPTY: "directory not empty",
}

_debug = False


def pop_debug_flag(argv: list[str]) -> list[str]:
    """Remove ``--debug`` from ``argv`` (any position) and remember it; returns the rest."""
    global _debug
    if "--debug" in argv:
        _debug = True
        argv = [a for a in argv if a != "--debug"]
    return argv


def debug_enabled() -> bool:
    return _debug or os.environ.get("K3_DEBUG", "") not in ("", "0")


def describe_error(e: BaseException) -> str | None:
    """One line for an error the user can act on, or None for a genuine bug (keep the traceback)."""
    if isinstance(e, (K3Error, ValueError)):  # ValueError: older raise sites not yet moved to K3Error
        return str(e)
    if isinstance(e, OSError):
        cause = _ERRNO_TEXT.get(e.errno or 0) or e.strerror or str(e)
        where = e.filename if e.filename is not None else ""
        if e.filename2 is not None:
            where = f"{where} -> {e.filename2}"
        return f"{where}: {cause}" if where else cause
    if isinstance(e, RuntimeError):
        # torch's zip writer / safetensors report ENOSPC and friends as RuntimeError text.
        text = str(e)
        for needle, cause in (("No space left", "no space left on device"),
                              ("Read-only file system", "read-only filesystem"),
                              ("Permission denied", "permission denied"),
                              ("file write failed", "a file write failed (disk full?)"),
                              ("unexpected pos", "a file write came up short (disk full?)")):
            if needle in text:
                return cause
    return None


def exit_quietly_on_signals() -> None:
    """After a command was stopped by a signal (its checkpoint written): a further Ctrl-C or
    SIGTERM, even during interpreter shutdown, ends the process at once instead of printing a
    KeyboardInterrupt traceback from an exit hook."""
    import signal
    import threading

    global _stopping
    _stopping = True
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda signum, frame: os._exit(128 + signum))


_stopping = False


def leave_now_if_stopping(code: int) -> None:
    """At the top of the ``k3`` command: a command stopped by a signal ends the process here,
    skipping interpreter finalization -- which puts back the default SIGINT action, so a second
    Ctrl-C landing during a slow torch shutdown would kill the process by signal. Everything that
    must survive (the checkpoint, metrics) is already on disk; only stdio needs a flush."""
    if _stopping:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(code)


def _interrupt_once_then_exit(signum, frame) -> None:
    """SIGINT while a command runs: the first raises KeyboardInterrupt (the command stops cleanly),
    any further one ends the process at once -- even when both arrive before Python could run the
    first handler's cleanup (a loaded machine delivers them together)."""
    global _interrupts, _last_signal
    _interrupts += 1
    _last_signal = signum
    if _interrupts > 1:
        os._exit(128 + signum)
    raise KeyboardInterrupt


_interrupts = 0
_last_signal: int | None = None


class sigterm_interrupts:
    """``with sigterm_interrupts():`` SIGTERM acts as Ctrl-C does under :func:`guarded` (the first
    raises KeyboardInterrupt, so ``finally`` blocks run -- e.g. closing sandboxes -- and the command
    exits 143; a second ends the process at once). For a command's phases outside the Trainer's own
    signal handling; the previous handler comes back on exit. A no-op off the main thread."""

    def __enter__(self):
        import signal
        import threading
        self.previous = None
        if threading.current_thread() is threading.main_thread():
            self.previous = signal.signal(signal.SIGTERM, _interrupt_once_then_exit)
        return self

    def __exit__(self, *exc) -> None:
        import signal
        if self.previous is not None:
            signal.signal(signal.SIGTERM, self.previous)


def guarded(cmd: str, fn: Callable[[], int]) -> int:
    """Run ``fn()``; map user-facing errors to one stderr line and exit 2 (see module docstring)."""
    import signal
    import threading

    global _interrupts, _stopping, _last_signal
    _stopping = False  # each command starts afresh (tests run several in one process)
    _last_signal = None
    previous = None
    if threading.current_thread() is threading.main_thread() and not debug_enabled():
        _interrupts = 0
        previous = signal.signal(signal.SIGINT, _interrupt_once_then_exit)
    try:
        return fn() or 0
    except KeyboardInterrupt:
        if debug_enabled():
            raise
        exit_quietly_on_signals()  # the process is on its way out: stays installed (see finally)
        sig = _last_signal or signal.SIGINT
        print(f"k3 {cmd}: interrupted" + (" (SIGTERM)" if sig == signal.SIGTERM else ""), file=sys.stderr)
        return 128 + sig
    except Exception as e:  # noqa: BLE001 - classified below; bugs are re-raised
        line = describe_error(e)
        if line is None or debug_enabled():
            raise
        print(f"k3 {cmd}: error: {line}", file=sys.stderr)
        return 2
    finally:
        # put back the caller's handler unless the command left a quiet exit in place
        if previous is not None and signal.getsignal(signal.SIGINT) is _interrupt_once_then_exit:
            signal.signal(signal.SIGINT, previous)
