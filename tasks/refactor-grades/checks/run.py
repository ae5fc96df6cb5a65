"""Visible checks for the grades refactor (python3 checks/run.py; exit 0 = pass)."""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
fails = []
WANT = """student         avg grade
ann            91.5 A
eve            90.0 A
bob            76.8 C
cy             59.0 F
course art: n=2 mean=84.50 max=88.0
course math: n=4 mean=79.12 max=95.0
class mean 80.92
skipped 2 bad rows
"""
res = subprocess.run([sys.executable, "grades.py", "data/term1.csv"], cwd=ROOT, capture_output=True, text=True, timeout=30)
if res.stdout != WANT:
    fails.append("python3 grades.py data/term1.csv printed %r" % res.stdout)
imp = subprocess.run([sys.executable, "-c", "import grades"], cwd=ROOT, capture_output=True, text=True, timeout=30)
if imp.returncode != 0 or imp.stdout:
    fails.append("importing grades must have no side effects (exit %d, %r)" % (imp.returncode, imp.stderr[-200:]))
else:
    import grades

    for name in ("load", "averages", "letter", "report", "main"):
        if not callable(getattr(grades, name, None)):
            fails.append("grades.%s is missing" % name)
    if not fails:
        if grades.letter(89.99) != "B" or grades.letter(90) != "A":
            fails.append("letter()")
        rows, bad = grades.load(os.path.join(ROOT, "data", "term1.csv"))
        if bad != 2 or grades.averages(rows)["ann"] != 91.5 or grades.report(rows, bad) != WANT:
            fails.append("load/averages/report")
print("\n".join(fails) or "all visible checks pass")
sys.exit(1 if fails else 0)
