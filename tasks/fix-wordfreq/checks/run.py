"""Visible checks for wordfreq.sh (python3 checks/run.py; exit 0 = pass)."""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
fails = []
for args, want in [(["poem.txt", "3"], "the 3\ncat 2\ncats 2\n"),
                   (["poem.txt", "1"], "the 3\n")]:
    res = subprocess.run(["/bin/sh", "wordfreq.sh"] + args, cwd=ROOT, capture_output=True, text=True, timeout=20)
    if res.stdout != want:
        fails.append("wordfreq.sh %s printed %r, want %r" % (" ".join(args), res.stdout, want))
print("\n".join(fails) or "all visible checks pass")
sys.exit(1 if fails else 0)
