"""Hidden verifier for impl-lru: random operation sequences against a reference, and memoize."""
import os
import random
import sys
from collections import OrderedDict

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import vharness  # noqa: E402

DRIVER = r'''
from lru import LRUCache, memoize
out = []
for cap, ops in payload["seqs"]:
    trace = []
    try:
        c = LRUCache(cap)
        for op in ops:
            if op[0] == "put":
                trace.append(c.put(op[1], op[2]))
            elif op[0] == "get":
                trace.append(c.get(op[1], "<absent>"))
            elif op[0] == "get1":
                trace.append(c.get(op[1]))
            elif op[0] == "in":
                trace.append(op[1] in c)
            else:
                trace.append([len(c), list(c.keys())])
    except Exception as e:
        trace.append("raised " + type(e).__name__)
    out.append(trace)
bad = []
for cap in payload["bad_caps"]:
    try:
        LRUCache(cap)
        bad.append("no error")
    except Exception as e:
        bad.append(type(e).__name__)
calls = []
@memoize(3)
def f(a, b):
    calls.append((a, b))
    return a * 10 + b
memo = [f(*args) for args in payload["memo"]]
emit({"seqs": out, "bad": bad, "memo": memo, "calls": len(calls), "info": list(f.cache_info())})
'''


def ref_trace(cap, ops):
    d, trace = OrderedDict(), []
    for op in ops:
        if op[0] == "put":
            if op[1] in d:
                d.move_to_end(op[1])
            d[op[1]] = op[2]
            if len(d) > cap:
                d.popitem(last=False)
            trace.append(None)
        elif op[0] in ("get", "get1"):
            if op[1] in d:
                d.move_to_end(op[1])
                trace.append(d[op[1]])
            else:
                trace.append("<absent>" if op[0] == "get" else None)
        elif op[0] == "in":
            trace.append(op[1] in d)
        else:
            trace.append([len(d), list(d)])
    return trace


def check(ctx):
    rng = random.Random(99)
    seqs = []
    for cap in (1, 2, 3, 5, 8, 1, 4):
        keys = ["k%d" % i for i in range(cap * 2 + 1)]
        ops = []
        for _ in range(400):
            r = rng.random()
            k = rng.choice(keys)
            if r < 0.4:
                ops.append(["put", k, rng.randint(0, 99)])
            elif r < 0.7:
                ops.append(["get", k])
            elif r < 0.8:
                ops.append(["get1", k])
            elif r < 0.9:
                ops.append(["in", k])
            else:
                ops.append(["state"])
        seqs.append([cap, ops])
    memo_args = [[rng.randint(0, 4), rng.randint(0, 2)] for _ in range(200)]
    got = ctx.results(DRIVER, ctx.fresh(), {"seqs": seqs, "bad_caps": [0, -3], "memo": memo_args})
    for i, ((cap, ops), g) in enumerate(zip(seqs, got["seqs"])):
        want = vharness.norm(ref_trace(cap, ops))
        if g != want:
            n = next((j for j, (a, b) in enumerate(zip(g, want)) if a != b), min(len(g), len(want)))
            raise vharness.Fail("sequence %d (capacity %d): step %d %r gave %r, want %r"
                                % (i, cap, n, ops[n] if n < len(ops) else None, g[n] if n < len(g) else None,
                                   want[n] if n < len(want) else None))
    if got["bad"] != ["ValueError", "ValueError"]:
        raise vharness.Fail("LRUCache(0)/LRUCache(-3) gave %r, want ValueError" % got["bad"])
    d, hits, misses = OrderedDict(), 0, 0
    for a, b in memo_args:
        key = (a, b)
        if key in d:
            hits += 1
            d.move_to_end(key)
        else:
            misses += 1
            d[key] = a * 10 + b
            if len(d) > 3:
                d.popitem(last=False)
    if got["memo"] != [a * 10 + b for a, b in memo_args] or got["calls"] != misses:
        raise vharness.Fail("memoize: wrong results or %d calls, want %d" % (got["calls"], misses))
    if got["info"] != [hits, misses, len(d)]:
        raise vharness.Fail("cache_info() = %r, want %r" % (got["info"], [hits, misses, len(d)]))
    return 1.0, "%d random sequences and memoize correct" % len(seqs)


if __name__ == "__main__":
    vharness.main(check, __file__)
