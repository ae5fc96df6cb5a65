"""Visible checks for sessions.py / sessions.tsv (python3 checks/run.py; exit 0 = pass)."""
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
want = "user\tsessions\tseconds\nalice\t2\t4800\nbob\t1\t3300\ncarol\t1\t900\n"
try:
    with open(os.path.join(ROOT, "sessions.tsv")) as f:
        got = f.read()
except OSError as e:
    got = "missing: %s" % e
fails = [] if got == want else ["sessions.tsv is %r, want %r" % (got, want)]
print("\n".join(fails) or "all visible checks pass")
sys.exit(1 if fails else 0)
