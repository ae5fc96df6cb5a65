"""Visible checks for flatten.py / data/users.csv (python3 checks/run.py; exit 0 = pass)."""
import csv
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
fails = []
try:
    with open(os.path.join(ROOT, "data", "users.csv"), newline="") as f:
        rows = list(csv.reader(f))
except OSError as e:
    rows = []
    fails.append("data/users.csv: %s" % e)
if rows:
    want_header = ["active", "address", "address.city", "address.zip", "id", "name", "notes.a.b", "score",
                   "tags", "tags.0", "tags.1"]
    if rows[0] != want_header:
        fails.append("header %r, want %r" % (rows[0], want_header))
    elif rows[1:] and rows[1] != ["true", "", "London", "N1", "1", "Ada", "", "", "", "admin", "dev"]:
        fails.append("row 1: %r" % rows[1])
    elif len(rows) != 4:
        fails.append("%d rows, want 3 data rows" % (len(rows) - 1))
print("\n".join(fails) or "all visible checks pass")
sys.exit(1 if fails else 0)
