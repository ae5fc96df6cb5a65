"""Visible checks for timeslots (python3 checks/run.py; exit 0 = pass)."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import timeslots as ts  # noqa: E402

fails = []


def expect(name, fn, want):
    try:
        got = fn()
    except Exception as e:  # noqa: BLE001
        got = "raised " + type(e).__name__
    if got != want:
        fails.append("%s: got %r, want %r" % (name, got, want))


expect("merge unsorted", lambda: ts.merge([(5, 7), (1, 3), (2, 4)]), [(1, 4), (5, 7)])
expect("merge touching", lambda: ts.merge([(1, 3), (3, 5)]), [(1, 5)])
expect("total", lambda: ts.total([(0, 10), (2, 3)]), 10)
expect("free", lambda: ts.free([(9, 10), (12, 13)], 8, 14), [(8, 9), (10, 12), (13, 14)])
expect("parse", lambda: ts.parse_slot("9:05-10:30"), (545, 630))
print("\n".join(fails) or "all visible checks pass")
sys.exit(1 if fails else 0)
