"""Hidden verifier for fix-inventory-tests: random operation scripts against a reference model."""
import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import vharness  # noqa: E402

DRIVER = r'''
from inventory import Item, Store, format_cents, report
out = []
for ops in payload["scripts"]:
    s = Store()
    trace = []
    for op in ops:
        try:
            name, args = op[0], op[1:]
            if name == "add":
                r = s.add(Item(*args))
            elif name == "state":
                r = sorted([k, v.qty] for k, v in s.items.items())
            else:
                r = getattr(s, name)(*args)
            trace.append(["ok", r])
        except Exception as e:
            trace.append(["err", type(e).__name__])
    try:
        trace.append(["report", report(s)])
    except Exception as e:
        trace.append(["err", type(e).__name__])
    out.append(trace)
emit({"scripts": out, "cents": [format_cents(c) for c in payload["cents"]]})
'''


def cents(c):
    return "$" + "{:,}".format(c // 100) + ".%02d" % (c % 100)


def run_ref(ops):
    items, trace = {}, []
    for op in ops:
        name, args = op[0], op[1:]
        if name == "add":
            sku, nm, qty, price = args
            ok = isinstance(qty, int) and qty >= 0 and price >= 0 and sku and all(c.isupper() or c.isdigit() or c == "-" for c in sku) \
                and not sku.startswith("-") and not sku.endswith("-") and "--" not in sku
            if not ok or sku in items:
                trace.append(["err", "ValueError"])
            else:
                items[sku] = [nm, qty, price]
                trace.append(["ok", None])
        elif name in ("remove", "restock"):
            sku, qty = args
            if sku not in items:
                trace.append(["err", "KeyError"])
            elif qty < 0 or (name == "remove" and qty > items[sku][1]):
                trace.append(["err", "ValueError"])
            else:
                items[sku][1] += qty if name == "restock" else -qty
                trace.append(["ok", None])
        elif name == "total_value":
            trace.append(["ok", sum(q * p for _n, q, p in items.values())])
        elif name == "low_stock":
            trace.append(["ok", sorted(k for k, v in items.items() if v[1] < args[0])])
        elif name == "find":
            trace.append(["ok", sorted(k for k, v in items.items() if args[0].lower() in v[0].lower())])
        else:
            trace.append(["ok", sorted([k, v[1]] for k, v in items.items())])
    lines = ["%s %s x%d @ %s" % (k, items[k][0], items[k][1], cents(items[k][2])) for k in sorted(items)]
    lines.append("total " + cents(sum(q * p for _n, q, p in items.values())))
    trace.append(["report", "\n".join(lines) + "\n"])
    return trace


def check(ctx):
    rng = random.Random(9)
    skus = ["A1", "B-2", "C", "ZZ-9-X", "D4", "bad", "-E", "F--G"]
    names = ["Bolt", "bolt long", "NUT", "Gear wheel", "Ünit"]
    scripts = []
    for _ in range(12):
        ops = []
        for _ in range(60):
            r = rng.random()
            sku = rng.choice(skus)
            if r < 0.3:
                ops.append(["add", sku, rng.choice(names), rng.choice([0, 1, 5, 50, -1]), rng.choice([0, 7, 199, 123456])])
            elif r < 0.5:
                ops.append(["remove", sku, rng.choice([0, 1, 3, 10, 60, -2])])
            elif r < 0.6:
                ops.append(["restock", sku, rng.choice([1, 4, -5])])
            elif r < 0.7:
                ops.append(["total_value"])
            elif r < 0.8:
                ops.append(["low_stock", rng.choice([0, 1, 5, 50])])
            elif r < 0.9:
                ops.append(["find", rng.choice(["bolt", "B", "nut", "x", "", "ün"])])
            else:
                ops.append(["state"])
        scripts.append(ops)
    money = [0, 5, 10, 99, 100, 101, 123456, 100000000, 99999999999]
    got = ctx.results(DRIVER, ctx.fresh(), {"scripts": scripts, "cents": money})
    for i, (ops, g) in enumerate(zip(scripts, got["scripts"])):
        want = vharness.norm(run_ref(ops))
        if g != want:
            k = next((j for j, (a, b) in enumerate(zip(g, want)) if a != b), 0)
            raise vharness.Fail("script %d step %d %r: got %r, want %r" % (i, k, ops[k] if k < len(ops) else "report",
                                                                        str(g[k])[:150], str(want[k])[:150]))
    if got["cents"] != [cents(c) for c in money]:
        raise vharness.Fail("format_cents gave %r" % got["cents"])
    return 1.0, "%d random operation scripts correct" % len(scripts)


if __name__ == "__main__":
    vharness.main(check, __file__)
