"""memoize(capacity): cache a function's results by positional arguments."""

import functools

from .cache import LRUCache

_MISSING = object()


def memoize(capacity):
    def wrap(fn):
        cache = LRUCache(capacity)
        stats = {"hits": 0, "misses": 0}

        @functools.wraps(fn)
        def inner(*args):
            value = cache.get(args, _MISSING)
            if value is _MISSING:
                stats["misses"] += 1
                value = fn(*args)
                cache.put(args, value)
            else:
                stats["hits"] += 1
            return value

        inner.cache_info = lambda: (stats["hits"], stats["misses"], len(cache))
        return inner

    return wrap
