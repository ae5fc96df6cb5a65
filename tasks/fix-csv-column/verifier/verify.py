"""Hidden verifier for fix-csv-column: other tables (CRLF, prefix names, short rows, spaces)."""
import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import vharness  # noqa: E402


def ref(text, name):
    lines = text.replace("\r", "").split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    header = lines[0].split(",")
    if name not in header:
        return None
    i = header.index(name)
    return "".join((row.split(",")[i] if i < len(row.split(",")) else "") + "\n" for row in lines[1:])


def table(rng, crlf):
    cols = rng.sample(["id", "user id", "user_id", "ids", "Name", "name", "total", "x"], rng.randint(2, 6))
    rows = [",".join(cols)]
    for r in range(rng.randint(0, 12)):
        n = len(cols) if rng.random() < 0.8 else rng.randint(1, len(cols))
        rows.append(",".join(rng.choice(["", "a b", "7", "-3.5", "x%d" % r, "é"]) for _ in range(n)))
    nl = "\r\n" if crlf else "\n"
    return nl.join(rows) + nl, cols


def check(ctx):
    rng = random.Random(8080)
    runs = 0
    for t in range(5):
        text, cols = table(rng, crlf=t % 2 == 1)
        ws = ctx.fresh({"in put.csv": text})
        for name in cols + ["missing", "id"]:
            want = ref(text, name)
            res = ctx.run(["/bin/sh", "col.sh", "in put.csv", name], ws)
            if want is None:
                if res.returncode != 1 or res.stdout:
                    raise vharness.Fail("column %r is absent from %r: exit %d, printed %r; want exit 1, nothing"
                                        % (name, cols, res.returncode, res.stdout[:80]))
            elif res.returncode != 0 or res.stdout != want:
                raise vharness.Fail("col.sh %r (header %r): exit %d, printed %r, want %r"
                                    % (name, cols, res.returncode, res.stdout[:120], want[:120]))
            runs += 1
    return 1.0, "%d hidden column extractions correct" % runs


if __name__ == "__main__":
    vharness.main(check, __file__)
