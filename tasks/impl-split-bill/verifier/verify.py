"""Hidden verifier for impl-split-bill: random totals and weights against an exact-fraction reference."""
import os
import random
import sys
from fractions import Fraction

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import vharness  # noqa: E402

DRIVER = r'''
import billing
def call(f, *a):
    try:
        return ["ok", f(*a)]
    except Exception as e:
        return ["err", type(e).__name__]
emit({"alloc": [call(billing.allocate, t, w) for t, w in payload["alloc"]],
      "inv": [call(lambda l, s: billing.split_invoice([tuple(x) for x in l], s), l, s) for l, s in payload["inv"]]})
'''


def ref(total, weights):
    bad = (isinstance(total, bool) or not isinstance(total, int) or total < 0 or not weights
           or any(isinstance(w, bool) or not isinstance(w, (int, float)) or w < 0 for w in weights)
           or sum(weights) == 0)
    if bad:
        return ["err", "ValueError"]
    ws = [Fraction(w) for w in weights]
    exact = [total * w / sum(ws) for w in ws]
    base = [int(e) for e in exact]
    left = total - sum(base)
    order = sorted(range(len(ws)), key=lambda i: (-(exact[i] - base[i]), i))
    for i in order[:left]:
        base[i] += 1
    return ["ok", base]


def check(ctx):
    rng = random.Random(808)
    alloc = []
    for _ in range(300):
        n = rng.randint(1, 7)
        weights = [rng.choice([0, 1, 1, 2, 3, 7, 10, 0.5, 2.25]) for _ in range(n)]
        alloc.append([rng.choice([0, 1, 2, 99, 100, 101, 12345, 10 ** 9 + 7]), weights])
    alloc += [[10, []], [10, [0, 0]], [-1, [1]], [10, [1, -1]], [2.5, [1]], [True, [1]], [7, [1, True]], [3, [1e-9, 1e-9]]]
    inv = []
    for _ in range(40):
        people = rng.sample(["ann", "bob", "cy", "dee", "eve"], rng.randint(1, 4))
        shares = {p: rng.choice([1, 1, 2, 3]) for p in people}
        lines = [["item%d" % i, rng.randint(0, 5000)] for i in range(rng.randint(0, 6))]
        inv.append([lines, shares])
    got = ctx.results(DRIVER, ctx.fresh(), {"alloc": alloc, "inv": inv})
    for (t, w), g in zip(alloc, got["alloc"]):
        if g != ref(t, w):
            raise vharness.Fail("allocate(%r, %r) gave %r, want %r" % (t, w, g, ref(t, w)))
    for (lines, shares), g in zip(inv, got["inv"]):
        people = sorted(shares)
        want = dict.fromkeys(people, 0)
        for _d, c in lines:
            for p, part in zip(people, ref(c, [shares[p] for p in people])[1]):
                want[p] += part
        if g != ["ok", want]:
            raise vharness.Fail("split_invoice(%r, %r) gave %r, want %r" % (lines, shares, g, want))
    return 1.0, "%d allocations and %d invoices correct" % (len(alloc), len(inv))


if __name__ == "__main__":
    vharness.main(check, __file__)
