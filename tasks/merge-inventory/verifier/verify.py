"""Hidden verifier for merge-inventory: data/merged.json, and merge.py on generated warehouses."""
import json
import os
import random
import sys
from decimal import Decimal

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import vharness  # noqa: E402


def load(name):
    with open(os.path.join(HERE, name)) as f:
        return json.load(f)


VIS_A, VIS_B = load("visible_a.json"), load("visible_b.json")


def ref(a, b):
    recs, errors = {}, set()
    for src, doc in ((0, a), (1, b)):
        for it in doc["items"]:
            sku = it["sku"].upper()
            if it["qty"] < 0:
                errors.add(sku)
            cur = recs.get(sku)
            if cur is None:
                recs[sku] = {"qty": it["qty"], "best": (it["updated"], -src, it)}
            else:
                cur["qty"] += it["qty"]
                cur["best"] = max(cur["best"], (it["updated"], -src, it), key=lambda t: (t[0], t[1]))
    items = []
    for sku in sorted(recs):
        if sku in errors:
            continue
        best = recs[sku]["best"][2]
        items.append({"sku": sku, "name": best["name"], "qty": recs[sku]["qty"],
                      "price": str(Decimal(best["price"]).quantize(Decimal("0.01")))})
    return {"items": items, "errors": sorted(errors)}


def gen(rng, n):
    skus = ["S%d" % i for i in range(n)] + ["s%d" % i for i in range(n // 2)]

    def doc():
        items = []
        for sku in rng.sample(skus, rng.randint(0, len(skus))):
            if any(x["sku"].upper() == sku.upper() for x in items):
                continue
            items.append({"sku": sku, "name": rng.choice(["Bolt", "Nut, hex", "Ünit", 'Q"x']),
                          "qty": rng.choice([0, 1, 5, 99, -1]) if rng.random() < 0.9 else 0,
                          "price": rng.choice(["1", "2.5", "0.125", "10.00", "3.999", "0"]),
                          "updated": "2026-%02d-%02d" % (rng.randint(1, 3), rng.randint(1, 3))})
        return {"items": items}
    return doc(), doc()


def check(ctx):
    ws = ctx.fresh()
    try:
        got = json.loads(vharness.read_text(ws, "data/merged.json"))
    except ValueError as e:
        raise vharness.Fail("data/merged.json is not JSON: %s" % e)
    if got != ref(VIS_A, VIS_B):
        raise vharness.Fail("data/merged.json is wrong: %s" % json.dumps(got)[:300])
    rng = random.Random(17)
    for n in (1, 6, 40):
        a, b = gen(rng, n)
        ws = ctx.fresh({"a.json": json.dumps(a), "b.json": json.dumps(b)})
        res = ctx.python("import runpy, sys\nsys.argv = ['merge.py', 'a.json', 'b.json', 'm.json']\n"
                         "runpy.run_path('merge.py', run_name='__main__')", ws, timeout=20)
        try:
            got = json.loads(vharness.read_text(ws, "m.json"))
        except (ValueError, vharness.Fail) as e:
            raise vharness.Fail("merge.py on hidden files: %s %s" % (e, res.stderr[-300:]))
        if got != ref(a, b):
            raise vharness.Fail("merge.py on hidden files gave %s..., want %s..." % (json.dumps(got)[:200], json.dumps(ref(a, b))[:200]))
    return 1.0, "merged.json and 3 hidden merges correct"


if __name__ == "__main__":
    vharness.main(check, __file__)
