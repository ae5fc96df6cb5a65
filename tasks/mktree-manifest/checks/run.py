"""Visible checks for mktree.sh (python3 checks/run.py; exit 0 = pass)."""
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
fails = []


def tree(root):
    out = []
    for d, dirs, files in os.walk(root):
        rel = os.path.relpath(d, root)
        out += [os.path.normpath(os.path.join(rel, x)) + "/" for x in dirs]
        out += [os.path.normpath(os.path.join(rel, x)) for x in files]
    return sorted(out)


with tempfile.TemporaryDirectory() as tmp:
    dest = os.path.join(tmp, "out")
    res = subprocess.run(["/bin/sh", "mktree.sh", "example.manifest", dest], cwd=ROOT, capture_output=True,
                         text=True, timeout=20)
    want = ["README", "docs/", "docs/user guide.md", "src/", "src/app/", "src/app/main.py", "tests/"]
    if res.returncode != 0 or not os.path.isdir(dest) or tree(dest) != want:
        fails.append("exit %d, tree %r, want %r" % (res.returncode, tree(dest) if os.path.isdir(dest) else None, want))
    bad = os.path.join(tmp, "bad.manifest")
    with open(bad, "w") as f:
        f.write("ok/\n../escape\n")
    res = subprocess.run(["/bin/sh", "mktree.sh", bad, os.path.join(tmp, "b")], cwd=ROOT, capture_output=True,
                         text=True, timeout=20)
    if res.returncode != 2 or os.path.exists(os.path.join(tmp, "b", "ok")):
        fails.append("a manifest with '..' must exit 2 and create nothing (exit %d)" % res.returncode)
print("\n".join(fails) or "all visible checks pass")
sys.exit(1 if fails else 0)
