"""Visible checks for merge.py / data/merged.json (python3 checks/run.py; exit 0 = pass)."""
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
fails = []
try:
    with open(os.path.join(ROOT, "data", "merged.json")) as f:
        got = json.load(f)
except (OSError, ValueError) as e:
    got = {}
    fails.append("data/merged.json: %s" % e)
if got:
    skus = [i.get("sku") for i in got.get("items", [])]
    if skus != ["BOLT-M6", "NUT-M6", "SPRING", "WASHER"]:
        fails.append("skus %r" % skus)
    elif got["items"][0] != {"sku": "BOLT-M6", "name": "Bolt M6 zinc", "qty": 120, "price": "0.15"}:
        fails.append("BOLT-M6: %r" % got["items"][0])
    elif got["items"][2]["price"] != "1.50":
        fails.append("SPRING price %r" % got["items"][2]["price"])
    if got.get("errors") != ["GEAR-1"]:
        fails.append("errors %r" % got.get("errors"))
print("\n".join(fails) or "all visible checks pass")
sys.exit(1 if fails else 0)
