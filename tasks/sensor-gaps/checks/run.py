"""Visible checks for scan.py / data/summary.json (python3 checks/run.py; exit 0 = pass)."""
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
fails = []
try:
    with open(os.path.join(ROOT, "data", "summary.json")) as f:
        got = json.load(f)
except (OSError, ValueError) as e:
    got = None
    fails.append("data/summary.json: %s" % e)
if got is not None:
    if got.get("invalid") != 3:
        fails.append("invalid: %r, want 3" % got.get("invalid"))
    t1 = got.get("sensors", {}).get("t1", {})
    if t1.get("gaps") != [[1300, 1601]] or t1.get("duplicates") != 1 or t1.get("count") != 3:
        fails.append("t1: %r" % t1)
    t2 = got.get("sensors", {}).get("t2", {})
    if t2.get("gaps") != [[1200, 2000]] or t2.get("min") != -1.5:
        fails.append("t2: %r" % t2)
print("\n".join(fails) or "all visible checks pass")
sys.exit(1 if fails else 0)
