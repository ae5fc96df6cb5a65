"""Hidden verifier for impl-semver: precedence over generated versions, invalid texts, stable sort."""
import functools
import os
import random
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import vharness  # noqa: E402

DRIVER = r'''
import semver
def call(f, *a):
    try:
        r = f(*a)
        return ["ok", list(r) if isinstance(r, tuple) else r]
    except Exception as e:
        return ["err", type(e).__name__]
emit({"parse": [call(semver.parse, s) for s in payload["parse"]],
      "cmp": [call(semver.compare, a, b) for a, b in payload["pairs"]],
      "sort": call(semver.sort_versions, payload["sort"])})
'''
NUM = r"(0|[1-9][0-9]*)"
IDENT = r"(0|[1-9][0-9]*|[0-9]*[A-Za-z-][0-9A-Za-z-]*)"
FULL = re.compile(r"%s\.%s\.%s(?:-(%s(?:\.%s)*))?(?:\+([0-9A-Za-z-]+(?:\.[0-9A-Za-z-]+)*))?" % (NUM, NUM, NUM, IDENT, IDENT))


def ref_parse(s):
    m = FULL.fullmatch(s)
    if not m:
        return ["err", "ValueError"]
    major, minor, patch, pre, build = m.group(1), m.group(2), m.group(3), m.group(4), m.group(m.lastindex) if "+" in s else None
    pre_ids = [int(x) if x.isdigit() else x for x in pre.split(".")] if pre else []
    return ["ok", [int(major), int(minor), int(patch), pre_ids, s.split("+", 1)[1] if "+" in s else ""]]


def key_cmp(a, b):
    pa, pb = ref_parse(a)[1], ref_parse(b)[1]
    if pa[:3] != pb[:3]:
        return -1 if pa[:3] < pb[:3] else 1
    xa, xb = pa[3], pb[3]
    if not xa or not xb:
        return (len(xb) > 0) - (len(xa) > 0) if (xa or xb) else 0
    for i, j in zip(xa, xb):
        if i == j:
            continue
        if isinstance(i, int) and isinstance(j, int):
            return -1 if i < j else 1
        if isinstance(i, int) != isinstance(j, int):
            return -1 if isinstance(i, int) else 1
        return -1 if i < j else 1
    return (len(xa) > len(xb)) - (len(xa) < len(xb))


def gen(rng):
    core = ".".join(str(rng.choice([0, 1, 2, 10, 11])) for _ in range(3))
    if rng.random() < 0.6:
        ids = [rng.choice(["alpha", "beta", "rc", "0", "1", "2", "11", "x-y", "A", "a1", "1a", "-"]) for _ in range(rng.randint(1, 3))]
        core += "-" + ".".join(ids)
    if rng.random() < 0.3:
        core += "+" + rng.choice(["b1", "exp.sha.5114f85", "001", "x-y"])
    return core


BAD = ["1.2", "1.2.3.4", "01.2.3", "1.02.3", "1.2.03", "1.2.3-", "1.2.3-01", "1.2.3-a..b", "1.2.3+", "1.2.3+a..b",
       "v1.2.3", " 1.2.3", "1.2.3 ", "1.2.3-a_b", "", "a.b.c", "1.2.3-+b", "-1.2.3", "1.2.3+b+c"]


def check(ctx):
    rng = random.Random(2)
    vers = sorted({gen(rng) for _ in range(150)})
    pairs = [[rng.choice(vers), rng.choice(vers)] for _ in range(600)]
    pairs += [["1.0.0-alpha", "1.0.0-alpha.1"], ["1.0.0-alpha.1", "1.0.0-alpha.beta"], ["1.0.0-beta.2", "1.0.0-beta.11"],
              ["1.0.0-rc.1", "1.0.0"], ["1.0.0-1", "1.0.0-a"], ["1.0.0-A", "1.0.0-a"], ["2.1.1", "2.1.0"]]
    to_sort = [rng.choice(vers) for _ in range(80)] + ["1.0.0+b", "1.0.0+a", "1.0.0"]
    got = ctx.results(DRIVER, ctx.fresh(), {"parse": vers + BAD, "pairs": pairs, "sort": to_sort})
    for s, g in zip(vers + BAD, got["parse"]):
        if g != ref_parse(s):
            raise vharness.Fail("parse(%r) gave %r, want %r" % (s, g, ref_parse(s)))
    for (a, b), g in zip(pairs, got["cmp"]):
        if g != ["ok", key_cmp(a, b)]:
            raise vharness.Fail("compare(%r, %r) gave %r, want %d" % (a, b, g, key_cmp(a, b)))
    want = sorted(to_sort, key=functools.cmp_to_key(key_cmp))
    if got["sort"] != ["ok", want]:
        raise vharness.Fail("sort_versions gave %r..., want %r..." % (str(got["sort"])[:200], want[:8]))
    return 1.0, "%d versions, %d invalid texts, %d comparisons and a stable sort correct" % (len(vers), len(BAD), len(pairs))


if __name__ == "__main__":
    vharness.main(check, __file__)
