"""Half-open time intervals [start, end): merge, total, free slots; 'HH:MM-HH:MM' parsing."""

from .intervals import free, merge, total
from .parse import parse_slot

__all__ = ["merge", "total", "free", "parse_slot"]
