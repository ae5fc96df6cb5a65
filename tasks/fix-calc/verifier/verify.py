"""Hidden verifier for fix-calc: random expressions against Python's own evaluation, error cases."""
import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import vharness  # noqa: E402

DRIVER = r'''
from calc import CalcError, evaluate
out = []
for text in payload:
    try:
        v = evaluate(text)
        out.append(["ok", float(v)])
    except CalcError:
        out.append(["CalcError"])
    except Exception as e:
        out.append(["other", type(e).__name__])
emit(out)
'''
ERRORS = ["1+", "", "   ", "()", "1 2", "(1", "1)", "2*/3", "4/0", "1.2.3", "a+1", "3 $ 4", "*2",
          "(2+3", "2+3)", "5/(2-2)", "7 8 +", "(()", "1--", "2 3.5"]


def gen(rng, depth):
    if depth == 0 or rng.random() < 0.3:
        num = str(rng.randint(0, 30)) if rng.random() < 0.7 else "%d.%02d" % (rng.randint(0, 9), rng.randint(0, 99))
        return ("-" * rng.choice([0, 0, 0, 1, 2])) + num
    left, right = gen(rng, depth - 1), gen(rng, depth - 1)
    sp = rng.choice(["", " "])
    text = left + sp + rng.choice("+-*/") + sp + right
    return "(" + text + ")" if rng.random() < 0.3 else text


def check(ctx):
    rng = random.Random(4242)
    exprs, wants = [], []
    while len(exprs) < 300:
        text = gen(rng, rng.randint(1, 4))
        try:
            want = float(eval(text, {"__builtins__": {}}))
        except ZeroDivisionError:
            continue
        if abs(want) < 1e12:
            exprs.append(text)
            wants.append(["ok", want])
    exprs += ERRORS
    wants += [["CalcError"]] * len(ERRORS)
    got = ctx.results(DRIVER, ctx.fresh(), exprs)
    for text, g, w in zip(exprs, got, wants):
        ok = g[0] == w[0] and (w[0] != "ok" or abs(g[1] - w[1]) <= 1e-9 * max(1.0, abs(w[1])))
        if not ok:
            raise vharness.Fail("evaluate(%r) gave %r, want %r" % (text, g, w))
    return 1.0, "%d expressions and %d malformed inputs correct" % (len(exprs) - len(ERRORS), len(ERRORS))


if __name__ == "__main__":
    vharness.main(check, __file__)
