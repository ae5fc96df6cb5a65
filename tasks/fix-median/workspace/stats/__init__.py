"""Tiny descriptive statistics."""

from .core import mean, median, mode
from .describe import describe

__all__ = ["mean", "median", "mode", "describe"]
