"""Visible checks for codes.sh (python3 checks/run.py; exit 0 = pass)."""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if not os.path.isfile(os.path.join(ROOT, "codes.sh")):
    print("codes.sh is missing")
    sys.exit(1)
res = subprocess.run(["/bin/sh", "codes.sh", "access.log"], cwd=ROOT, capture_output=True, text=True, timeout=30)
want = "200 2\n404 2\n500 1\n"
fails = [] if res.stdout == want else ["codes.sh access.log printed %r, want %r" % (res.stdout, want)]
print("\n".join(fails) or "all visible checks pass")
sys.exit(1 if fails else 0)
