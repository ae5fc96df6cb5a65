"""Visible checks for summarise.py / report.json (python3 checks/run.py; exit 0 = pass)."""
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
fails = []
try:
    with open(os.path.join(ROOT, "report.json")) as f:
        report = json.load(f)
except (OSError, ValueError) as e:
    report = None
    fails.append("report.json: %s" % e)
if report is not None:
    if report.get("rows") != 5 or report.get("rejected") != 4:
        fails.append("rows/rejected: %r/%r, want 5/4" % (report.get("rows"), report.get("rejected")))
    if report.get("top_product") != "Widget":
        fails.append("top_product: %r" % report.get("top_product"))
    if abs(report.get("total_revenue", 0) - 104.98) > 0.005:
        fails.append("total_revenue: %r" % report.get("total_revenue"))
with tempfile.TemporaryDirectory() as tmp:
    src = os.path.join(tmp, "in.csv")
    with open(src, "w") as f:
        f.write("date,region,product,units,unit_price\n2026-01-01,x,P,2,1.25\n")
    out = os.path.join(tmp, "out.json")
    subprocess.run([sys.executable, os.path.join(ROOT, "summarise.py"), src, out], timeout=30)
    try:
        with open(out) as f:
            small = json.load(f)
        if small != {"total_revenue": 2.5, "by_region": {"x": 2.5}, "top_product": "P", "rows": 1, "rejected": 0}:
            fails.append("summarise.py on a one-row file gave %r" % small)
    except (OSError, ValueError) as e:
        fails.append("summarise.py gave no JSON: %s" % e)
print("\n".join(fails) or "all visible checks pass")
sys.exit(1 if fails else 0)
