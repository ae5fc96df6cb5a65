"""Visible checks for rotate.sh (python3 checks/run.py; exit 0 = pass). Works on a copy of logs/."""
import os
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
fails = []
with tempfile.TemporaryDirectory() as tmp:
    d = os.path.join(tmp, "my logs")
    shutil.copytree(os.path.join(ROOT, "logs"), d)
    res = subprocess.run(["/bin/sh", os.path.join(ROOT, "rotate.sh"), d, "2"], capture_output=True, text=True, timeout=20)
    if res.returncode != 0:
        fails.append("exit %d: %s" % (res.returncode, res.stderr.strip()))
    if res.stdout != "app-20251230.log\napp-20260101.log\n":
        fails.append("printed %r, want the two oldest, oldest first" % res.stdout)
    left = sorted(os.listdir(d))
    if left != ["app-20260103.log", "app-20260105.log", "app-notes.log"]:
        fails.append("left %r" % left)
    res = subprocess.run(["/bin/sh", os.path.join(ROOT, "rotate.sh"), d, "x"], capture_output=True, text=True, timeout=20)
    if res.returncode != 2:
        fails.append("KEEP=x: exit %d, want 2" % res.returncode)
print("\n".join(fails) or "all visible checks pass")
sys.exit(1 if fails else 0)
