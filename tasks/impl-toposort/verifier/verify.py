"""Hidden verifier for impl-toposort: random DAGs (smallest order), random cyclic graphs (a valid cycle)."""
import heapq
import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import vharness  # noqa: E402

DRIVER = r'''
import deps
out = []
for g in payload:
    try:
        out.append(["ok", deps.order(g)])
    except deps.CycleError as e:
        out.append(["cycle", list(e.cycle)])
    except Exception as e:
        out.append(["other", type(e).__name__])
emit(out)
'''


def smallest(graph):
    nodes = set(graph) | {d for ds in graph.values() for d in ds}
    need = {n: set(graph.get(n, ())) for n in nodes}
    users = {n: set() for n in nodes}
    for n, ds in need.items():
        for d in ds:
            users[d].add(n)
    ready = [n for n in nodes if not need[n]]
    heapq.heapify(ready)
    out = []
    while ready:
        n = heapq.heappop(ready)
        out.append(n)
        for u in users[n]:
            need[u].discard(n)
            if not need[u]:
                heapq.heappush(ready, u)
    return out if len(out) == len(nodes) else None


def valid_cycle(graph, cyc):
    if not isinstance(cyc, list) or len(cyc) < 2 or cyc[0] != cyc[-1]:
        return False
    if len(set(cyc[:-1])) != len(cyc) - 1:
        return False
    return all(isinstance(a, str) and b in graph.get(a, ()) for a, b in zip(cyc, cyc[1:]))


def graphs(rng):
    out = [{}, {"solo": []}, {"a": ["a"]}, {"z": ["y"], "y": ["x"]}, {"n": ["m", "m"]}]
    for size in (4, 8, 15, 40, 120):
        names = ["m%02d" % i for i in range(size)]
        rng.shuffle(names)
        g = {}
        for i, n in enumerate(names):
            if rng.random() < 0.9:
                g[n] = rng.sample(names[:i], min(i, rng.randint(0, 3)))
        out.append(g)
        cyc = {k: list(v) for k, v in g.items()}
        a, b = rng.sample(names, 2)
        cyc.setdefault(a, []).append(b)
        cyc.setdefault(b, []).append(a)
        out.append(cyc)
        big = {k: list(v) for k, v in g.items()}
        ring = rng.sample(names, min(size, 5))
        for x, y in zip(ring, ring[1:] + ring[:1]):
            big.setdefault(x, []).append(y)
        out.append(big)
    return out


def check(ctx):
    cases = graphs(random.Random(123))
    got = ctx.results(DRIVER, ctx.fresh(), cases)
    for g, r in zip(cases, got):
        want = smallest(g)
        if want is not None and r != ["ok", want]:
            raise vharness.Fail("order(%d-node graph) gave %r, want %r" % (len(g), r[:2] if len(str(r)) < 300 else str(r)[:300], want[:20]))
        if want is None and not (r[0] == "cycle" and valid_cycle(g, r[1])):
            raise vharness.Fail("a cyclic graph gave %r, want CycleError with a real cycle" % (str(r)[:300],))
    return 1.0, "%d hidden graphs correct" % len(cases)


if __name__ == "__main__":
    vharness.main(check, __file__)
