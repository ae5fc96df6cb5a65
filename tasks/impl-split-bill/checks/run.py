"""Visible checks for billing (python3 checks/run.py; exit 0 = pass)."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import billing  # noqa: E402

fails = []


def expect(name, fn, want):
    try:
        got = fn()
    except Exception as e:  # noqa: BLE001
        got = "raised " + type(e).__name__
    if got != want:
        fails.append("%s: got %r, want %r" % (name, got, want))


expect("thirds", lambda: billing.allocate(100, [1, 1, 1]), [34, 33, 33])
expect("weights", lambda: billing.allocate(1000, [3, 1]), [750, 250])
expect("remainder order", lambda: billing.allocate(5, [1, 2]), [2, 3])
expect("zero weight", lambda: billing.allocate(10, [0, 1]), [0, 10])
expect("invoice", lambda: billing.split_invoice([("a", 100), ("b", 1)], {"x": 1, "y": 1}), {"x": 51, "y": 50})
expect("no weights", lambda: billing.allocate(10, [0, 0]), "raised ValueError")
print("\n".join(fails) or "all visible checks pass")
sys.exit(1 if fails else 0)
