"""Visible checks for numerals.py (python3 checks/run.py; exit 0 = pass)."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from numerals import from_roman, to_roman  # noqa: E402

fails = []
for n, s in [(1, "I"), (4, "IV"), (9, "IX"), (14, "XIV"), (40, "XL"), (1994, "MCMXCIV"), (3999, "MMMCMXCIX")]:
    try:
        if to_roman(n) != s:
            fails.append("to_roman(%d) = %r, want %r" % (n, to_roman(n), s))
        if from_roman(s) != n:
            fails.append("from_roman(%r) = %r, want %d" % (s, from_roman(s), n))
    except Exception as e:  # noqa: BLE001
        fails.append("%d/%s raised %s" % (n, s, type(e).__name__))
for bad in (0, 4000):
    try:
        to_roman(bad)
        fails.append("to_roman(%d) did not raise" % bad)
    except ValueError:
        pass
    except Exception as e:  # noqa: BLE001
        fails.append("to_roman(%d) raised %s, want ValueError" % (bad, type(e).__name__))
try:
    from_roman("IIII")
    fails.append("from_roman('IIII') did not raise")
except ValueError:
    pass
except Exception as e:  # noqa: BLE001
    fails.append("from_roman('IIII') raised %s" % type(e).__name__)
print("\n".join(fails) or "all visible checks pass")
sys.exit(1 if fails else 0)
