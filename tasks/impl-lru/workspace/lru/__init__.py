"""A least-recently-used cache and a memoizing decorator built on it."""

from .cache import LRUCache
from .memo import memoize

__all__ = ["LRUCache", "memoize"]
