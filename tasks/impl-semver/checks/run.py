"""Visible checks for semver.py (python3 checks/run.py; exit 0 = pass)."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import semver  # noqa: E402

fails = []
try:
    if semver.parse("1.2.3-rc.1+b5") != (1, 2, 3, ("rc", 1), "b5"):
        fails.append("parse: %r" % (semver.parse("1.2.3-rc.1+b5"),))
    if semver.compare("1.0.0-alpha", "1.0.0") != -1 or semver.compare("2.0.0", "10.0.0") != -1:
        fails.append("compare basics")
    if semver.compare("1.0.0+a", "1.0.0+b") != 0:
        fails.append("build metadata must not matter")
    got = semver.sort_versions(["1.0.0", "1.0.0-rc.1", "1.0.0-beta", "0.9.9"])
    if got != ["0.9.9", "1.0.0-beta", "1.0.0-rc.1", "1.0.0"]:
        fails.append("sort: %r" % got)
except Exception as e:  # noqa: BLE001
    fails.append("raised %s: %s" % (type(e).__name__, e))
for bad in ("1.2", "01.2.3"):
    try:
        semver.parse(bad)
        fails.append("parse(%r) did not raise ValueError" % bad)
    except ValueError:
        pass
    except Exception as e:  # noqa: BLE001
        fails.append("parse(%r) raised %s" % (bad, type(e).__name__))
print("\n".join(fails) or "all visible checks pass")
sys.exit(1 if fails else 0)
