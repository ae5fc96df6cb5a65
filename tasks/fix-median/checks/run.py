"""Visible checks for stats/ (run: python3 checks/run.py; exit 0 = all pass)."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import stats  # noqa: E402

fails = []


def check(name, fn, want):
    try:
        got = fn()
    except Exception as e:  # noqa: BLE001
        got = "raised %s" % type(e).__name__
    if got != want:
        fails.append("%s: got %r, want %r" % (name, got, want))


check("median odd", lambda: stats.median([3, 1, 2]), 2)
check("median even", lambda: stats.median([4, 1, 3, 2]), 2.5)
check("mode tie", lambda: stats.mode([2, 1, 2, 1]), 1)
check("mean tuple", lambda: stats.mean((1, 2, 3, 4)), 2.5)
check("describe", lambda: stats.describe([5, 1, 1]),
      {"count": 3, "mean": 7 / 3, "median": 1, "mode": 1, "min": 1, "max": 5})
try:
    stats.median([])
    fails.append("median([]) did not raise ValueError")
except ValueError:
    pass
except Exception as e:  # noqa: BLE001
    fails.append("median([]) raised %s, want ValueError" % type(e).__name__)
print("\n".join(fails) or "all visible checks pass")
sys.exit(1 if fails else 0)
