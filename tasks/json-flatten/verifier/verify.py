"""Hidden verifier for json-flatten: data/users.csv, and flatten.py on generated documents."""
import csv
import io
import json
import os
import random
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import vharness  # noqa: E402

with open(os.path.join(HERE, "visible_users.json")) as _f:
    VISIBLE = json.load(_f)


def cell(v):
    if v is None:
        return ""
    if v is True or v is False:
        return "true" if v else "false"
    if isinstance(v, str):
        return v
    return json.dumps(v)


def flat(value, prefix, out):
    if isinstance(value, dict):
        if not value and prefix:
            out[prefix] = ""
        for k, v in value.items():
            flat(v, prefix + "." + k if prefix else k, out)
    elif isinstance(value, list):
        if not value:
            out[prefix] = ""
        for i, v in enumerate(value):
            flat(v, "%s.%d" % (prefix, i), out)
    else:
        out[prefix] = cell(value)


def ref(records):
    rows = []
    for r in records:
        out = {}
        flat(r, "", out)
        rows.append(out)
    header = sorted(set(k for r in rows for k in r))
    return [header] + [[r.get(k, "") for k in header] for r in rows]


def parse(text):
    return list(csv.reader(io.StringIO(text, newline="")))


def value(rng, depth):
    r = rng.random()
    if depth > 2 or r < 0.5:
        return rng.choice([0, -3, 2.25, 1e21, "s", "a,b", 'q"q', "line\nbreak", "", True, False, None, "ü"])
    if r < 0.75:
        return [value(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    return {rng.choice(["k", "x", "y z", "n"]) + str(i): value(rng, depth + 1) for i in range(rng.randint(0, 3))}


def check(ctx):
    ws = ctx.fresh()
    got = parse(vharness.read_text(ws, "data/users.csv"))
    if got != ref(VISIBLE):
        raise vharness.Fail("data/users.csv is wrong: %r" % got[:2])
    rng = random.Random(5)
    for n in (1, 4, 30):
        recs = [{"id": i, "v": value(rng, 0), "w": value(rng, 1)} for i in range(n)]
        ws = ctx.fresh({"in.json": json.dumps(recs)})
        res = ctx.python("import runpy, sys\nsys.argv = ['flatten.py', 'in.json', 'o u t.csv']\n"
                         "runpy.run_path('flatten.py', run_name='__main__')", ws, timeout=20)
        try:
            with open(os.path.join(ws, "o u t.csv"), encoding="utf-8", newline="") as f:
                got = parse(f.read())
        except OSError:
            raise vharness.Fail("flatten.py wrote no output: %s" % res.stderr[-300:])
        if got != ref(recs):
            want = ref(recs)
            diff = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
            raise vharness.Fail("flatten.py on %d hidden records: row %r differs: got %r, want %r"
                                % (n, diff, got[diff] if diff is not None else got[-1:], want[diff] if diff is not None else want[-1:]))
    return 1.0, "users.csv and 3 hidden documents correct"


if __name__ == "__main__":
    vharness.main(check, __file__)
