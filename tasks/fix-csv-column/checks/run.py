"""Visible checks for col.sh (python3 checks/run.py; exit 0 = pass)."""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
fails = []
for name, want in [("name", "Ada\nBob\nCy\n"), ("city", "London\nParis\n\n"), ("id", "1\n2\n3\n")]:
    res = subprocess.run(["/bin/sh", "col.sh", "people.csv", name], cwd=ROOT, capture_output=True, text=True, timeout=20)
    if res.stdout != want or res.returncode != 0:
        fails.append("col.sh people.csv %s printed %r (exit %d), want %r" % (name, res.stdout, res.returncode, want))
res = subprocess.run(["/bin/sh", "col.sh", "people.csv", "age"], cwd=ROOT, capture_output=True, text=True, timeout=20)
if res.returncode != 1 or res.stdout:
    fails.append("a missing column must print nothing and exit 1 (exit %d, %r)" % (res.returncode, res.stdout))
print("\n".join(fails) or "all visible checks pass")
sys.exit(1 if fails else 0)
