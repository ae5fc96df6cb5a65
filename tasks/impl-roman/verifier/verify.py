"""Hidden verifier for impl-roman: the whole range both ways, type errors, invalid numerals."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import vharness  # noqa: E402

DRIVER = r'''
from numerals import from_roman, to_roman
def call(f, x):
    try:
        return ["ok", f(x)]
    except Exception as e:
        return ["err", type(e).__name__]
emit({"to": [call(to_roman, n) for n in range(1, 4000)],
      "from": [call(from_roman, s) for s in payload["numerals"]],
      "bad_to": [call(to_roman, x) for x in [0, -7, 4000, 10**6]],
      "type_to": [call(to_roman, x) for x in [True, 3.0, "12", None]],
      "bad_from": [call(from_roman, s) for s in payload["bad"]]})
'''
PAIRS = [(1000, "M"), (900, "CM"), (500, "D"), (400, "CD"), (100, "C"), (90, "XC"),
         (50, "L"), (40, "XL"), (10, "X"), (9, "IX"), (5, "V"), (4, "IV"), (1, "I")]
BAD = ["", "IIII", "VV", "VX", "IC", "IL", "XM", "LC", "DM", "CCCC", "MMMM", "IIX", "XXXX", "iv",
       "mcm", "IXI", "XCX", "CMC", "VIV", " X", "X ", "I I", "ABC", "MMMCMXCIXI", "IVI", "DD", "LL"]


def roman(n):
    out = []
    for v, s in PAIRS:
        while n >= v:
            out.append(s)
            n -= v
    return "".join(out)


def check(ctx):
    want_to = [roman(n) for n in range(1, 4000)]
    order = sorted(range(3999), key=lambda i: (i * 7919) % 3999)
    numerals = [want_to[i] for i in order]
    got = ctx.results(DRIVER, ctx.fresh(), {"numerals": numerals, "bad": BAD}, timeout=20)
    for n, (g, w) in enumerate(zip(got["to"], want_to), 1):
        if g != ["ok", w]:
            raise vharness.Fail("to_roman(%d) gave %r, want %r" % (n, g, w))
    for i, g in zip(order, got["from"]):
        if g != ["ok", i + 1]:
            raise vharness.Fail("from_roman(%r) gave %r, want %d" % (want_to[i], g, i + 1))
    for g in got["bad_to"]:
        if g != ["err", "ValueError"]:
            raise vharness.Fail("to_roman out of range gave %r, want ValueError" % (g,))
    for g in got["type_to"]:
        if g != ["err", "TypeError"]:
            raise vharness.Fail("to_roman of a non-int gave %r, want TypeError" % (g,))
    for s, g in zip(BAD, got["bad_from"]):
        if g != ["err", "ValueError"]:
            raise vharness.Fail("from_roman(%r) gave %r, want ValueError" % (s, g))
    return 1.0, "whole range and %d invalid numerals correct" % len(BAD)


if __name__ == "__main__":
    vharness.main(check, __file__)
