"""Hidden verifier for fix-latency-report: data/report.json, and the script on generated logs."""
import json
import math
import os
import random
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import vharness  # noqa: E402

with open(os.path.join(HERE, "visible_requests.jsonl")) as _f:
    VISIBLE = _f.read()


def norm_path(p):
    p = p.split("?", 1)[0]
    return p.rstrip("/") or "/"


def nearest_rank(values, p):
    values = sorted(values)
    return values[max(1, math.ceil(p / 100 * len(values))) - 1]


def ref(text):
    per, skipped = {}, 0
    for line in text.splitlines():
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            path, status, ms = rec["path"], rec["status"], rec["ms"]
            ok = (isinstance(rec, dict) and isinstance(path, str) and path.startswith("/")
                  and type(status) is int and type(ms) in (int, float) and ms >= 0)
        except (ValueError, KeyError, TypeError):
            ok = False
        if not ok:
            skipped += 1
            continue
        per.setdefault(norm_path(path), []).append((status, ms))
    out = {}
    for path in sorted(per):
        recs = per[path]
        ms = [m for _s, m in recs]
        out[path] = {"count": len(recs), "p50": nearest_rank(ms, 50), "p95": nearest_rank(ms, 95),
                     "error_rate": round(sum(1 for s, _m in recs if s >= 500) / len(recs), 4)}
    out["_skipped"] = skipped
    return out


def gen(rng, n):
    lines = []
    for _ in range(n):
        r = rng.random()
        rec = {"path": rng.choice(["/a", "/a/", "/a?x=1", "/b/c", "/b/c/?q", "/", "/?z"]),
               "status": rng.choice([200, 200, 201, 304, 404, 499, 500, 502, 503]),
               "ms": rng.choice([rng.randint(0, 2000), round(rng.uniform(0, 50), 2)])}
        if r < 0.04:
            del rec["ms"]
        elif r < 0.07:
            rec["status"] = "500"
        elif r < 0.09:
            rec["path"] = "a"
        elif r < 0.11:
            rec["ms"] = -1
        line = json.dumps(rec)
        if rng.random() < 0.03:
            line = rng.choice(["{", "[]", "null", "42", '{"path": "/a"}'])
        lines.append(line)
    return "\n".join(lines) + "\n"


def check(ctx):
    ws = ctx.fresh()
    try:
        got = json.loads(vharness.read_text(ws, "data/report.json"))
    except ValueError as e:
        raise vharness.Fail("data/report.json is not JSON: %s" % e)
    if got != ref(VISIBLE):
        raise vharness.Fail("data/report.json is wrong: %s" % json.dumps(got)[:300])
    rng = random.Random(95)
    for n in (0, 1, 20, 500):
        text = gen(rng, n)
        ws = ctx.fresh({"in.jsonl": text})
        res = ctx.python("import runpy, sys\nsys.argv = ['latency_report.py', 'in.jsonl', 'o.json']\n"
                         "runpy.run_path('latency_report.py', run_name='__main__')", ws, timeout=20)
        try:
            got = json.loads(vharness.read_text(ws, "o.json"))
        except (ValueError, vharness.Fail) as e:
            raise vharness.Fail("latency_report.py on a hidden log: %s %s" % (e, res.stderr[-300:]))
        if got != ref(text):
            raise vharness.Fail("latency_report.py on a hidden %d-line log gave %s..., want %s..."
                                % (n, json.dumps(got)[:200], json.dumps(ref(text))[:200]))
    return 1.0, "report.json and 4 hidden logs correct"


if __name__ == "__main__":
    vharness.main(check, __file__)
