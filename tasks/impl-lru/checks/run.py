"""Visible checks for lru (python3 checks/run.py; exit 0 = pass)."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from lru import LRUCache, memoize  # noqa: E402

fails = []


def expect(name, got, want):
    if got != want:
        fails.append("%s: got %r, want %r" % (name, got, want))


try:
    c = LRUCache(2)
    c.put("a", 1)
    c.put("b", 2)
    expect("get a", c.get("a"), 1)
    c.put("c", 3)
    expect("b evicted", "b" in c, False)
    expect("keys", c.keys(), ["a", "c"])
    expect("len", len(c), 2)
    expect("default", c.get("zz", -1), -1)

    @memoize(2)
    def sq(x):
        return x * x

    expect("memo", [sq(2), sq(2), sq(3)], [4, 4, 9])
    expect("cache_info", sq.cache_info(), (1, 2, 2))
except Exception as e:  # noqa: BLE001
    fails.append("raised %s: %s" % (type(e).__name__, e))
try:
    LRUCache(0)
    fails.append("LRUCache(0) did not raise ValueError")
except ValueError:
    pass
except Exception as e:  # noqa: BLE001
    fails.append("LRUCache(0) raised %s" % type(e).__name__)
print("\n".join(fails) or "all visible checks pass")
sys.exit(1 if fails else 0)
