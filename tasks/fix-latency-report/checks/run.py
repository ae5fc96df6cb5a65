"""Visible checks for latency_report.py / data/report.json (python3 checks/run.py; exit 0 = pass)."""
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WANT = {"/api/orders": {"count": 3, "p50": 45, "p95": 900, "error_rate": 0.3333},
        "/api/users": {"count": 4, "p50": 18, "p95": 250, "error_rate": 0.25},
        "_skipped": 3}
try:
    with open(os.path.join(ROOT, "data", "report.json")) as f:
        got = json.load(f)
except (OSError, ValueError) as e:
    got = "unreadable: %s" % e
fails = [] if got == WANT else ["data/report.json is %r, want %r" % (got, WANT)]
print("\n".join(fails) or "all visible checks pass")
sys.exit(1 if fails else 0)
