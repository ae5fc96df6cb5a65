"""Hidden verifier for fix-median: other inputs (generators, floats, negatives, ties, empties)."""
import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import vharness  # noqa: E402

DRIVER = r'''
import stats
def as_kind(kind, xs):
    return {"list": list, "tuple": tuple, "gen": lambda v: (x for x in v)}[kind](xs)
out = []
for fn, kind, xs in payload:
    try:
        out.append(["ok", getattr(stats, fn)(as_kind(kind, xs))])
    except Exception as e:
        out.append(["err", type(e).__name__])
emit(out)
'''


def ref(fn, xs):
    if not xs:
        return ["err", "ValueError"]
    s = sorted(xs)
    n = len(s)
    med = s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2
    best = max(xs.count(v) for v in xs)
    mode = min(v for v in xs if xs.count(v) == best)
    mean = sum(xs) / n
    if fn == "median":
        return ["ok", med]
    if fn == "mode":
        return ["ok", mode]
    if fn == "mean":
        return ["ok", mean]
    return ["ok", {"count": n, "mean": mean, "median": med, "mode": mode, "min": s[0], "max": s[-1]}]


def close(a, b):
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(close(a[k], b[k]) for k in a)
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
        return abs(a - b) <= 1e-9 * max(1.0, abs(b))
    return a == b


def check(ctx):
    rng = random.Random(1729)
    samples = [[], [7], [-3, -3, 10], [2.5, -1.25, 8.0, 0.5], [9, 9, 4, 4, 1, 1]]
    for n in (2, 3, 6, 11, 40):
        samples.append([rng.randint(-50, 50) for _ in range(n)])
        samples.append([round(rng.uniform(-5, 5), 3) for _ in range(n)])
    cases = [[fn, kind, xs] for xs in samples for fn in ("median", "mean", "mode", "describe")
             for kind in ("list", "tuple", "gen")]
    got = ctx.results(DRIVER, ctx.fresh(), cases)
    if len(got) != len(cases):
        raise vharness.Fail("driver returned %d results for %d cases" % (len(got), len(cases)))
    for (fn, kind, xs), g in zip(cases, got):
        want = vharness.norm(ref(fn, xs))
        if not (g[0] == want[0] and close(g[1], want[1])):
            raise vharness.Fail("%s(%s %r) gave %r, want %r" % (fn, kind, xs, g, want))
    return 1.0, "all %d hidden cases pass" % len(cases)


if __name__ == "__main__":
    vharness.main(check, __file__)
