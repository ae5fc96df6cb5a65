"""Visible checks for calc (python3 checks/run.py; exit 0 = pass)."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from calc import CalcError, evaluate  # noqa: E402

fails = []
for text, want in [("1 + 2*3", 7), ("10-4-3", 3), ("8/4/2", 1.0), ("-2*3", -6), ("2*-3", -6),
                   ("1.5*2", 3.0), ("(1+2)*(3-1)", 6), ("--4", 4)]:
    try:
        got = evaluate(text)
        if abs(got - want) > 1e-9:
            fails.append("%r = %r, want %r" % (text, got, want))
    except Exception as e:  # noqa: BLE001
        fails.append("%r raised %s" % (text, type(e).__name__))
for text in ["1+", "(1", "1 2", "4/0"]:
    try:
        evaluate(text)
        fails.append("%r did not raise CalcError" % text)
    except CalcError:
        pass
    except Exception as e:  # noqa: BLE001
        fails.append("%r raised %s, want CalcError" % (text, type(e).__name__))
print("\n".join(fails) or "all visible checks pass")
sys.exit(1 if fails else 0)
