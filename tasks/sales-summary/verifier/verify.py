"""Hidden verifier for sales-summary: report.json for the given data, and summarise.py on generated files."""
import csv
import io
import json
import os
import random
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import vharness  # noqa: E402

with open(os.path.join(HERE, "visible_sales.csv")) as _f:
    VISIBLE = _f.read()


def ref(text):
    rows = list(csv.reader(io.StringIO(text)))[1:]
    by_region, by_product, ok, bad = {}, {}, 0, 0
    for row in rows:
        if not row or all(not c.strip() for c in row):
            continue
        if len(row) != 5:
            bad += 1
            continue
        _date, region, product, units, price = (c.strip() for c in row)
        try:
            u = int(units)
            p = float(price)
        except ValueError:
            bad += 1
            continue
        if u < 0 or not p >= 0 or p == float("inf") or not region or not product:
            bad += 1
            continue
        ok += 1
        by_region[region.lower()] = by_region.get(region.lower(), 0.0) + u * p
        by_product[product] = by_product.get(product, 0.0) + u * p
    top = min(by_product, key=lambda k: (-by_product[k], k)) if by_product else None
    return {"total_revenue": round(sum(by_region.values()), 2),
            "by_region": {k: round(v, 2) for k, v in sorted(by_region.items())},
            "top_product": top, "rows": ok, "rejected": bad}


def same(got, want):
    if not isinstance(got, dict) or set(got) != set(want):
        return False
    for k, w in want.items():
        g = got[k]
        if k == "total_revenue":
            if not isinstance(g, (int, float)) or abs(g - w) > 0.005:
                return False
        elif k == "by_region":
            if not isinstance(g, dict) or set(g) != set(w) or any(
                    not isinstance(g[r], (int, float)) or abs(g[r] - w[r]) > 0.005 for r in w):
                return False
        elif g != w:
            return False
    return True


def gen(rng, n):
    out = io.StringIO()
    wr = csv.writer(out, lineterminator=rng.choice(["\n", "\r\n"]))
    wr.writerow(["date", "region", "product", "units", "unit_price"])
    for i in range(n):
        region = rng.choice(["North", "north", " NORTH", "South", "east", "Far West", ""])
        product = rng.choice(["Widget", "widget", "Gadget, large", 'Bolt "M6"', "Nut", "Ünit"])
        units = rng.choice([str(rng.randint(0, 50)), str(rng.randint(0, 50)), "", "-2", "3.5", " 7 ", "x"])
        price = rng.choice(["%.2f" % rng.uniform(0, 40), "%.2f" % rng.uniform(0, 40), "1e1", "", "nan", "-1", "free"])
        row = ["2026-11-%02d" % (i % 28 + 1), region, product, units, price]
        if rng.random() < 0.05:
            row = row[:rng.randint(1, 4)]
        if rng.random() < 0.04:
            row = []
        wr.writerow(row)
    return out.getvalue()


def check(ctx):
    ws = ctx.fresh()
    try:
        report = json.loads(vharness.read_text(ws, "report.json"))
    except ValueError as e:
        raise vharness.Fail("report.json is not JSON: %s" % e)
    if not same(report, ref(VISIBLE)):
        raise vharness.Fail("report.json for data/sales.csv is wrong: %r" % (report,))
    rng = random.Random(11)
    for n in (0, 5, 60, 500):
        text = gen(rng, n)
        ws = ctx.fresh({"hidden in.csv": text})
        res = ctx.python("import runpy, sys\nsys.argv = ['summarise.py', 'hidden in.csv', 'out.json']\n"
                         "runpy.run_path('summarise.py', run_name='__main__')", ws, timeout=20)
        try:
            with open(os.path.join(ws, "out.json")) as f:
                got = json.load(f)
        except (OSError, ValueError) as e:
            raise vharness.Fail("summarise.py on a hidden %d-row file wrote no JSON (%s) %s" % (n, e, res.stderr[-300:]))
        if not same(got, ref(text)):
            raise vharness.Fail("summarise.py on a hidden %d-row file gave %r, want %r" % (n, got, ref(text)))
    return 1.0, "report.json and 4 hidden files correct"


if __name__ == "__main__":
    vharness.main(check, __file__)
