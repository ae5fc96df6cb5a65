"""Hidden verifier for refactor-ledger: the package vs the original module on other ledgers."""
import ast
import os
import random
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import vharness  # noqa: E402

with open(os.path.join(HERE, "original.py")) as _f:
    ORIGINAL = _f.read()

DRIVER = r'''
import ledger
def call(name, arg):
    try:
        if name == "format_amount":
            from decimal import Decimal
            arg = Decimal(arg)
        return ["ok", repr(getattr(ledger, name)(arg))]
    except Exception as e:
        return ["err", type(e).__name__]
emit([call(name, arg) for name, arg in payload])
'''
MODULES = ("__init__", "parse", "balance", "report", "__main__")


def ledgers(rng):
    accounts = ["Checking", "checking", "Rent", "food", "FOOD", "Salary", "x-1"]
    texts = []
    for n in range(8):
        rows = ["# generated %d" % n, ""]
        for _ in range(rng.randint(1, 25)):
            amt = "%d.%02d" % (rng.randint(0, 99999), rng.randint(0, 99))
            if rng.random() < 0.4:
                amt = "{:,.2f}".format(float(amt))
            amt = rng.choice([amt, "(" + amt + ")", "-" + amt, amt.split(".")[0]])
            memo = rng.choice(["", "  memo text", " a (b) c"])
            rows.append("2026-%02d-%02d  %s  %s%s" % (rng.randint(1, 12), rng.randint(1, 28),
                                                    rng.choice(accounts), amt, memo))
            if rng.random() < 0.1:
                rows.append("   ")
        texts.append("\n".join(rows) + "\n")
    texts += ["", "# only a comment\n", "2026-01-01 a (12\n", "2026-01-01 a 12)\n", "2026-01-01 a 1.5\n",
              "2026-01-01 a 1.234\n", "bad line\n", "2026-01-01  a\n", "2026-13-40 a 1\n",
              "2026-01-01 a 1,,2\n", "2026-01-01 a (-3)\n"]
    return texts


def run_all(ctx, ws, calls):
    return ctx.results(DRIVER, ws, calls, timeout=20)


def check(ctx):
    rng = random.Random(7)
    texts = ledgers(rng)
    lines = [ln for t in texts for ln in t.splitlines()][:120]
    amounts = ["12", "(12.00)", "-3.5", "1,234.56", "(1,000)", "0.00", "7"]
    calls = [[f, t] for t in texts for f in ("parse_file", "balances", "monthly", "report")]
    calls += [["parse_line", ln] for ln in lines]
    calls += [["format_amount", s] for s in ("0", "-0.004", "1234.5", "-1234.567", "1e6")]
    ws = ctx.fresh()
    for m in MODULES:
        path = os.path.join(ws, "ledger", m + ".py")
        if not os.path.isfile(path):
            raise vharness.Fail("missing ledger/%s.py" % m)
    if os.path.exists(os.path.join(ws, "ledger.py")):
        raise vharness.Fail("ledger.py was submitted")
    for m in MODULES:
        tree = ast.parse(vharness.read_text(ws, "ledger/%s.py" % m))
        imports = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
        imports += [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module]
        if m != "parse" and ("re" in imports):
            raise vharness.Fail("ledger/%s.py imports re (only ledger/parse.py may)" % m)
        if m == "balance" and "parse" not in imports:
            raise vharness.Fail("ledger/balance.py does not use ledger.parse")
    ref_ws = ctx.fresh({"ref/ledger.py": ORIGINAL})
    want = ctx.results("import sys; sys.path.insert(0, 'ref')\n" + DRIVER, ref_ws,
                       [[f, a] for f, a in calls if f != "parse_amount"], timeout=20)
    calls_repr = [[f, a] for f, a in calls]
    got = ctx.results(DRIVER, ws, calls_repr, timeout=20)
    for (f, a), g, w in zip(calls, got, want):
        if g != w:
            raise vharness.Fail("%s(%r) gave %r, the original gives %r" % (f, a if len(repr(a)) < 80 else "...", g, w))
    pa = ctx.results("import ledger\nemit([repr(ledger.parse_amount(s)) for s in payload])", ws, amounts)
    wa = ["Decimal('12')", "Decimal('-12.00')", "Decimal('-3.5')", "Decimal('1234.56')", "Decimal('-1000')",
          "Decimal('0.00')", "Decimal('7')"]
    if pa != wa:
        raise vharness.Fail("parse_amount gave %r, want %r" % (pa, wa))
    sample = texts[0]
    ws2 = ctx.fresh({"in.ledger": sample})
    res = ctx.python("import runpy, sys\nsys.path.insert(0, %r)\nsys.argv = ['ledger', 'in.ledger']\n"
                     "runpy.run_module('ledger', run_name='__main__', alter_sys=True)" % ws2, ws2)
    if res.stdout != eval(want[3][1]):
        raise vharness.Fail("python3 -m ledger printed %r %r" % (res.stdout[:200], res.stderr[-200:]))
    return 1.0, "package matches the original on %d calls" % len(calls)


if __name__ == "__main__":
    vharness.main(check, __file__)
