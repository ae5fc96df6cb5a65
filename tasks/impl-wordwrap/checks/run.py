"""Visible checks for textfmt.wrap (python3 checks/run.py; exit 0 = pass)."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from textfmt import wrap  # noqa: E402

fails = []


def expect(name, fn, want):
    try:
        got = fn()
    except Exception as e:  # noqa: BLE001
        got = "raised " + type(e).__name__
    if got != want:
        fails.append("%s: got %r, want %r" % (name, got, want))


expect("greedy", lambda: wrap("the quick brown fox jumps", 10), ["the quick", "brown fox", "jumps"])
expect("long word", lambda: wrap("a abcdefghij b", 4), ["a", "abcd", "efgh", "ij b"])
expect("paragraphs", lambda: wrap("one two\n\n\nthree", 20), ["one two", "", "three"])
expect("empty", lambda: wrap("   \n ", 5), [])
expect("bad width", lambda: wrap("x", 0), "raised ValueError")
print("\n".join(fails) or "all visible checks pass")
sys.exit(1 if fails else 0)
