"""Hidden verifier for fix-intervals: random interval sets against a unit-cell reference."""
import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import vharness  # noqa: E402

DRIVER = r'''
import timeslots as ts
def call(f, *a):
    try:
        return ["ok", f(*a)]
    except Exception as e:
        return ["err", type(e).__name__]
out = []
for kind, arg in payload:
    if kind == "merge":
        out.append(call(lambda x: [list(p) for p in ts.merge([tuple(p) for p in x])], arg))
    elif kind == "gen":
        out.append(call(lambda x: [list(p) for p in ts.merge(tuple(p) for p in x)], arg))
    elif kind == "total":
        out.append(call(lambda x: ts.total([tuple(p) for p in x]), arg))
    elif kind == "free":
        out.append(call(lambda x: [list(p) for p in ts.free([tuple(p) for p in x[0]], x[1], x[2])], arg))
    else:
        out.append(call(lambda s: list(ts.parse_slot(s)), arg))
emit(out)
'''


def cells(ivs):
    return sorted({c for s, e in ivs for c in range(s, e)})


def runs(cs):
    out = []
    for c in cs:
        if out and out[-1][1] == c:
            out[-1][1] = c + 1
        else:
            out.append([c, c + 1])
    return out


def slot(text):
    import re
    m = re.fullmatch(r"(\d{1,2}):(\d\d)-(\d{1,2}):(\d\d)", text.strip())
    if not m:
        return ["err", "ValueError"]
    h1, m1, h2, m2 = map(int, m.groups())
    if h1 > 23 or h2 > 24 or m1 > 59 or m2 > 59 or (h2 == 24 and m2) or h1 * 60 + m1 > h2 * 60 + m2:
        return ["err", "ValueError"]
    return ["ok", [h1 * 60 + m1, h2 * 60 + m2]]


def check(ctx):
    rng = random.Random(60)
    cases, wants = [], []
    for n in (0, 1, 2, 5, 12, 30, 30, 60):
        ivs = []
        for _ in range(n):
            s = rng.randint(0, 80)
            ivs.append([s, s + rng.choice([0, 0, 1, 2, 3, 5, 10, 25])])
        merged = runs(cells(ivs))
        lo, hi = rng.randint(-5, 40), rng.randint(40, 100)
        window = cells([[lo, hi]])
        gaps = runs(sorted(set(window) - set(cells(ivs))))
        cases += [["merge", ivs], ["gen", ivs], ["total", ivs], ["free", [ivs, lo, hi]]]
        wants += [["ok", merged], ["ok", merged], ["ok", len(cells(ivs))], ["ok", gaps]]
    for bad in ([[3, 1]], [[0, 2], [5, 4]]):
        cases += [["merge", bad], ["total", bad]]
        wants += [["err", "ValueError"]] * 2
    for s in ["09:00-10:00", "9:05-10:30", " 7:00-7:00 ", "23:59-24:00", "10:00-9:00", "25:00-26:00",
              "9:60-10:00", "9-10", "09:00 - 10:00", "x", "24:30-24:40"]:
        cases.append(["slot", s])
        wants.append(slot(s))
    got = ctx.results(DRIVER, ctx.fresh(), cases)
    for c, g, w in zip(cases, got, wants):
        if g != w:
            raise vharness.Fail("%s(%s) gave %r, want %r" % (c[0], str(c[1])[:160], g, w))
    return 1.0, "%d hidden cases correct" % len(cases)


if __name__ == "__main__":
    vharness.main(check, __file__)
