"""Hidden verifier for fix-etl-contacts: the two outputs, and the script on generated exports."""
import csv
import io
import os
import random
import re
import sys
from datetime import date

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import vharness  # noqa: E402

with open(os.path.join(HERE, "visible_contacts.csv")) as _f:
    VISIBLE = _f.read()
EMAIL = re.compile(r"^[^@\s]+@[^@\s]+\.[^@\s]+$")


def phone(text):
    d = "".join(c for c in text if c in "0123456789")
    if len(d) == 10:
        return "+1" + d
    if len(d) == 11 and d[0] == "1":
        return "+" + d
    return None


def signup(text):
    t = text.strip()
    for pat, order in ((r"(\d{4})-(\d{2})-(\d{2})", "ymd"), (r"(\d{2})/(\d{2})/(\d{4})", "mdy"),
                       (r"(\d{2})\.(\d{2})\.(\d{4})", "dmy")):
        m = re.fullmatch(pat, t)
        if m:
            parts = dict(zip(order, m.groups()))
            try:
                return date(int(parts["y"]), int(parts["m"]), int(parts["d"])).isoformat()
            except ValueError:
                return None
    return None


def ref(text):
    clean, rej, seen = [["name", "email", "phone", "signup"]], [["line", "reason"]], set()
    for i, row in enumerate(csv.DictReader(io.StringIO(text)), 1):
        name = " ".join((row["name"] or "").split())
        email = (row["email"] or "").strip().lower()
        ph, sg = phone(row["phone"] or ""), signup(row["signup"] or "")
        reason = ("name" if not name else "email" if not EMAIL.match(email) else "phone" if ph is None
                  else "signup" if sg is None else "duplicate" if email in seen else None)
        if reason:
            rej.append([str(i), reason])
        else:
            seen.add(email)
            clean.append([name, email, ph, sg])
    return clean, rej


def rows(text):
    return list(csv.reader(io.StringIO(text.replace("\r\n", "\n"))))


def gen(rng, n):
    out = io.StringIO()
    w = csv.writer(out, lineterminator="\n")
    w.writerow(["name", "email", "phone", "signup"])
    for i in range(n):
        name = rng.choice(["Ann", "  Bo  Ek ", "", "Zoë Q", "A\tB", "   "])
        email = rng.choice(["a%d@x.org" % (i % 7), "A%d@X.org " % (i % 7), "bad", "x@y", "p q@r.s", "ok%d@m.io" % i])
        ph = rng.choice(["555 010 %04d" % i, "1-555-010-%04d" % i, "+1 (555) 010-%04d" % i, "2-555-010-0000", "12",
                         "555010%04d" % i, ""])
        sg = rng.choice(["2026-%02d-%02d" % (rng.randint(1, 13), rng.randint(1, 31)),
                         "%02d/%02d/2025" % (rng.randint(1, 13), rng.randint(1, 31)),
                         "%02d.%02d.2024" % (rng.randint(1, 31), rng.randint(1, 13)), "2026/01/01", "", "29.02.2024"])
        w.writerow([name, email, ph, sg])
    return out.getvalue()


def check(ctx):
    ws = ctx.fresh()
    want_c, want_r = ref(VISIBLE)
    if rows(vharness.read_text(ws, "data/clean.csv")) != want_c:
        raise vharness.Fail("data/clean.csv is wrong")
    if rows(vharness.read_text(ws, "data/rejects.csv")) != want_r:
        raise vharness.Fail("data/rejects.csv is wrong")
    rng = random.Random(3)
    for n in (1, 25, 300):
        text = gen(rng, n)
        ws = ctx.fresh({"in.csv": text})
        res = ctx.python("import runpy, sys\nsys.argv = ['clean_contacts.py', 'in.csv', 'c.csv', 'r.csv']\n"
                         "runpy.run_path('clean_contacts.py', run_name='__main__')", ws, timeout=20)
        want_c, want_r = ref(text)
        try:
            got_c, got_r = rows(vharness.read_text(ws, "c.csv")), rows(vharness.read_text(ws, "r.csv"))
        except vharness.Fail as e:
            raise vharness.Fail("%s: %s" % (e, res.stderr[-300:]))
        for what, g, w in (("clean", got_c, want_c), ("rejects", got_r, want_r)):
            if g != w:
                k = next((j for j, (a, b) in enumerate(zip(g, w)) if a != b), min(len(g), len(w)))
                raise vharness.Fail("%s output on a hidden %d-row export: row %d is %r, want %r"
                                    % (what, n, k, g[k] if k < len(g) else None, w[k] if k < len(w) else None))
    return 1.0, "outputs and 3 hidden exports correct"


if __name__ == "__main__":
    vharness.main(check, __file__)
