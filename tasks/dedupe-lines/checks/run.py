"""Visible checks for dedupe.sh (python3 checks/run.py; exit 0 = pass)."""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
fails = []
if not os.path.isfile(os.path.join(ROOT, "dedupe.sh")):
    print("dedupe.sh is missing")
    sys.exit(1)


def run(args, stdin=""):
    return subprocess.run(["/bin/sh", "dedupe.sh"] + args, cwd=ROOT, input=stdin, capture_output=True,
                          text=True, timeout=20).stdout


want = "apple\nbanana\n  apple\ncherry\n\n"
if run(["sample.txt"]) != want:
    fails.append("dedupe.sh sample.txt printed %r, want %r" % (run(["sample.txt"]), want))
if run([], "b\na\nb\n") != "b\na\n":
    fails.append("stdin: %r" % run([], "b\na\nb\n"))
print("\n".join(fails) or "all visible checks pass")
sys.exit(1 if fails else 0)
