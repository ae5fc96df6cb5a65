"""Hidden verifier for sensor-gaps: data/summary.json, and scan.py on generated readings."""
import csv
import io
import json
import math
import os
import random
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import vharness  # noqa: E402

with open(os.path.join(HERE, "visible_readings.csv")) as _f:
    VISIBLE = _f.read()


def ref(text):
    invalid, per = 0, {}
    rows = list(csv.reader(io.StringIO(text)))[1:]
    for row in rows:
        if not row:
            continue
        try:
            if len(row) != 3:
                raise ValueError
            ts, sensor, value = int(row[0].strip()), row[1].strip(), float(row[2].strip())
            if not sensor or not math.isfinite(value):
                raise ValueError
        except ValueError:
            invalid += 1
            continue
        d = per.setdefault(sensor, {"seen": {}, "dups": 0})
        if ts in d["seen"]:
            d["dups"] += 1
        else:
            d["seen"][ts] = value
    out = {}
    for sensor, d in sorted(per.items()):
        pts = sorted(d["seen"].items())
        vals = [v for _t, v in pts]
        gaps = [[a[0], b[0]] for a, b in zip(pts, pts[1:]) if b[0] - a[0] > 300]
        out[sensor] = {"count": len(pts), "min": min(vals), "max": max(vals), "mean": round(sum(vals) / len(vals), 3),
                       "gaps": gaps, "duplicates": d["dups"]}
    return {"invalid": invalid, "sensors": out}


def same(g, w):
    if isinstance(w, dict):
        return isinstance(g, dict) and set(g) == set(w) and all(same(g[k], w[k]) for k in w)
    if isinstance(w, list):
        return isinstance(g, list) and len(g) == len(w) and all(same(a, b) for a, b in zip(g, w))
    if isinstance(w, float):
        return isinstance(g, (int, float)) and not isinstance(g, bool) and abs(g - w) <= 1e-9 * max(1, abs(w))
    return g == w and type(g) is type(w)


def gen(rng, n):
    rows = ["timestamp,sensor,value"]
    for _ in range(n):
        r = rng.random()
        ts = str(rng.choice([rng.randint(0, 5000), rng.randint(0, 40) * 100]))
        sensor = rng.choice(["a", "b", "c d", " e "])
        value = "%.2f" % rng.uniform(-50, 50)
        if r < 0.05:
            ts = rng.choice(["1.5", "", "x", "1e3"])
        elif r < 0.08:
            value = rng.choice(["", "nan", "inf", "abc"])
        elif r < 0.1:
            sensor = ""
        rows.append(",".join([ts, sensor, value]) if rng.random() > 0.02 else ts)
    return "\n".join(rows) + "\n"


def check(ctx):
    ws = ctx.fresh()
    try:
        got = json.loads(vharness.read_text(ws, "data/summary.json"))
    except ValueError as e:
        raise vharness.Fail("data/summary.json is not JSON: %s" % e)
    if not same(got, ref(VISIBLE)):
        raise vharness.Fail("data/summary.json is wrong: %s" % json.dumps(got)[:300])
    rng = random.Random(21)
    for n in (0, 10, 200, 2000):
        text = gen(rng, n)
        ws = ctx.fresh({"r.csv": text})
        res = ctx.python("import runpy, sys\nsys.argv = ['scan.py', 'r.csv', 'o.json']\n"
                         "runpy.run_path('scan.py', run_name='__main__')", ws, timeout=20)
        try:
            got = json.loads(vharness.read_text(ws, "o.json"))
        except (ValueError, vharness.Fail) as e:
            raise vharness.Fail("scan.py on hidden data: %s %s" % (e, res.stderr[-300:]))
        if not same(got, ref(text)):
            raise vharness.Fail("scan.py on %d hidden rows gave %s..., want %s..." % (n, json.dumps(got)[:200], json.dumps(ref(text))[:200]))
    return 1.0, "summary.json and 4 hidden files correct"


if __name__ == "__main__":
    vharness.main(check, __file__)
