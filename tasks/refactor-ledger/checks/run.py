"""Visible checks for the ledger refactor (python3 checks/run.py; exit 0 = pass)."""
import ast
import os
import subprocess
import sys
from decimal import Decimal

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
fails = []
for rel in ("ledger/__init__.py", "ledger/parse.py", "ledger/balance.py", "ledger/report.py", "ledger/__main__.py"):
    if not os.path.isfile(os.path.join(ROOT, rel)):
        fails.append("missing " + rel)
if os.path.exists(os.path.join(ROOT, "ledger.py")):
    fails.append("ledger.py still exists")
if not fails:
    import ledger

    with open(os.path.join(ROOT, "data", "sample.ledger")) as f:
        text = f.read()
    want = {"checking": Decimal("1345.80"), "groceries": Decimal("54.20"), "rent": Decimal("1100.00"),
            "salary": Decimal("-2500.00")}
    if ledger.balances(text) != want:
        fails.append("balances: %r" % ledger.balances(text))
    if ledger.parse_amount("(1,234.50)") != Decimal("-1234.50"):
        fails.append("parse_amount('(1,234.50)')")
    if ledger.format_amount(Decimal("-1234.5")) != "(1,234.50)":
        fails.append("format_amount")
    out = subprocess.run([sys.executable, "-m", "ledger", os.path.join(ROOT, "data", "sample.ledger")],
                         cwd=ROOT, capture_output=True, text=True).stdout
    if not out.startswith("checking") or "TOTAL" not in out:
        fails.append("python3 -m ledger: %r" % out[:200])
    for rel in ("ledger/balance.py", "ledger/report.py", "ledger/__init__.py"):
        tree = ast.parse(open(os.path.join(ROOT, rel)).read())
        names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
        if "re" in names:
            fails.append(rel + " imports re")
print("\n".join(fails) or "all visible checks pass")
sys.exit(1 if fails else 0)
