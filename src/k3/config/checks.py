"""The value checks every k3 config and CLI validates with (``check_int``, ``check_float``,
``check_bool``, ``check_choice``, ``refuse_unknown`` with its did-you-mean): a wrong value raises
:class:`ConfigError` naming the field."""

from __future__ import annotations

import difflib
import math
from typing import Any, Iterable

from k3.errors import ConfigError

__all__ = ["INT_MAX", "MAX_LAYERS", "check_int", "check_float", "check_bool", "check_choice", "did_you_mean",
           "refuse_unknown", "check_dict"]

INT_MAX = 2**31 - 1  # every size / id / count fits int32 (torch index kernels, safetensors shapes)
MAX_LAYERS = 65536   # linear_attn_config lists every layer, so a config names each one


def check_int(name: str, v: Any, lo: int | None = None, hi: int | None = INT_MAX,
              allow_none: bool = False) -> None:
    """``v`` is an int (not a bool) in [lo, hi], or None when allowed."""
    if v is None and allow_none:
        return
    if isinstance(v, bool) or not isinstance(v, int):
        raise ConfigError(f"{name} must be an int{' or null' if allow_none else ''}, got {v!r}")
    if lo is not None and v < lo:
        raise ConfigError(f"{name} must be {'> 0' if lo == 1 else f'>= {lo}'}, got {v}")
    if hi is not None and v > hi:
        raise ConfigError(f"{name} must be <= {hi}, got {v}")


def check_float(name: str, v: Any, lo: float | None = None, hi: float | None = None,
                lo_open: bool = False, allow_none: bool = False) -> None:
    """``v`` is a finite real (an int counts, a bool does not) with lo ≤ v ≤ hi (lo < v if lo_open)."""
    if v is None and allow_none:
        return
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ConfigError(f"{name} must be a number{' or null' if allow_none else ''}, got {v!r}")
    if not math.isfinite(v):
        raise ConfigError(f"{name} must be finite, got {v}")
    if lo is not None and (v <= lo if lo_open else v < lo):
        raise ConfigError(f"{name} must be {'>' if lo_open else '>='} {lo}, got {v}")
    if hi is not None and v > hi:
        raise ConfigError(f"{name} must be <= {hi}, got {v}")


def check_bool(name: str, v: Any, allow_none: bool = False) -> None:
    """``v`` is ``True`` / ``False`` itself: the strings "false"/"no" and 0/1 are refused, not cast."""
    if v is None and allow_none:
        return
    if not isinstance(v, bool):
        raise ConfigError(f"{name} must be true or false, got {v!r} ({type(v).__name__})")


def check_choice(name: str, v: Any, choices: Iterable[Any], allow_none: bool = False) -> None:
    choices = tuple(choices)
    if v is None and allow_none:
        return
    if not isinstance(v, str) or v not in choices:
        raise ConfigError(f"{name} must be one of {list(choices)}, got {v!r}")


def did_you_mean(key: str, known: Iterable[str]) -> str:
    """`` (did you mean 'x'?)`` for the closest known name, or ``""``."""
    close = difflib.get_close_matches(str(key), list(known), n=1, cutoff=0.75)
    return f" (did you mean {close[0]!r}?)" if close else ""


def refuse_unknown(keys: Iterable[str], known: Iterable[str], where: str) -> None:
    """ConfigError naming every key of ``keys`` not in ``known``, each with a did-you-mean."""
    known = list(known)
    unknown = [k for k in keys if k not in known]
    if unknown:
        names = ", ".join(f"{k!r}{did_you_mean(k, known)}" for k in unknown)
        raise ConfigError(f"{where}: unknown option(s) {names}")


def check_dict(name: str, v: Any, allow_none: bool = True) -> None:
    if not (isinstance(v, dict) or (v is None and allow_none)):
        raise ConfigError(f"{name} must be a JSON object{' or null' if allow_none else ''}, got {v!r}")
