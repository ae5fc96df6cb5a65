"""Hidden verifier for refactor-grades: CLI output identical to the original script on other files; the API."""
import csv
import io
import os
import random
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import vharness  # noqa: E402

with open(os.path.join(HERE, "original_grades.py")) as _f:
    ORIGINAL = _f.read()

API = r'''
import io, contextlib
buf = io.StringIO()
with contextlib.redirect_stdout(buf):
    import grades
out = {"import_output": buf.getvalue()}
out["letters"] = [grades.letter(x) for x in payload["letters"]]
res = []
for path in payload["files"]:
    rows, bad = grades.load(path)
    res.append({"rows": [list(r) for r in rows], "bad": bad,
                "avgs": sorted([k, round(v, 9)] for k, v in grades.averages(rows).items()),
                "report": grades.report(rows, bad)})
out["files"] = res
b2 = io.StringIO()
with contextlib.redirect_stdout(b2):
    rc = grades.main([payload["files"][0]])
out["main"] = [rc, b2.getvalue()]
emit(out)
'''


def gen(rng, n):
    out = io.StringIO()
    w = csv.writer(out, lineterminator=rng.choice(["\n", "\r\n"]))
    if rng.random() < 0.8:
        w.writerow(["student", "course", "score"])
    for _ in range(n):
        row = [rng.choice(["ann", " bob", "cy ", "dee", "Émile", "f"]), rng.choice(["math", "art", " bio"]),
               rng.choice(["%d" % rng.randint(0, 100), "%.2f" % rng.uniform(0, 100), "100", "0", "-1", "100.5", "x", "",
                           "1e2", "89.95", "59.99"])]
        if rng.random() < 0.05:
            row = row[:2]
        if rng.random() < 0.03:
            row = []
        w.writerow(row)
    return out.getvalue()


def check(ctx):
    rng = random.Random(42)
    files = {"f%d.csv" % i: gen(rng, n) for i, n in enumerate((0, 1, 6, 40, 200))}
    ws = ctx.fresh(dict(files, **{"ref/grades.py": ORIGINAL}))
    wants = {}
    for name in files:
        want = ctx.run([sys.executable, "-I", "-S", "ref/grades.py", name], ws)
        wants[name] = want.stdout
        got = ctx.run([sys.executable, "-I", "-S", "grades.py", name], ws)
        if got.stdout != want.stdout:
            raise vharness.Fail("python3 grades.py on a hidden file printed %r..., the original %r..."
                                % (got.stdout[:200], want.stdout[:200]))
    api = ctx.results(API, ws, {"files": sorted(files), "letters": [100, 90, 89.99, 80, 79.5, 70, 60, 59.999, 0]})
    if api["import_output"]:
        raise vharness.Fail("importing grades printed %r" % api["import_output"][:100])
    if api["letters"] != ["A", "A", "B", "B", "C", "C", "D", "F", "F"]:
        raise vharness.Fail("letter() gave %r" % api["letters"])
    for name, r in zip(sorted(files), api["files"]):
        if r["report"] != wants[name]:
            raise vharness.Fail("report(*load(%s)) differs from the original output" % name)
    if api["main"] != [0, wants[sorted(files)[0]]]:
        raise vharness.Fail("main([FILE]) gave %r, want (0, the report)" % (api["main"],))
    return 1.0, "CLI and API match the original on %d hidden files" % len(files)


if __name__ == "__main__":
    vharness.main(check, __file__)
