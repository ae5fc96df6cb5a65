"""Hidden verifier for count-status-codes: generated logs (spaces in requests, decoy numbers, bad lines)."""
import os
import random
import sys
from collections import Counter

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import vharness  # noqa: E402

CODES = ["200", "200", "200", "301", "302", "304", "400", "401", "403", "404", "404", "500", "502", "503"]


def gen(rng, n):
    lines, counts = [], Counter()
    for i in range(n):
        r = rng.random()
        path = rng.choice(["/", "/a b", "/x?q=1 2", "/404", "/200 OK"])
        agent = rng.choice(['"curl/8"', '"Mozilla/5.0 (X11; 404)"', '"-"', '"bot 500 x"'])
        if r < 0.08:
            lines.append(rng.choice(["junk", "", "1.2.3.4 - - [x] no request 200 1", '"GET / HTTP/1.1" - 0']))
            continue
        code = rng.choice(CODES)
        if r < 0.12:
            code = rng.choice(["-", "2000", "20x", "99"])
        else:
            counts[code] += 1
        lines.append('10.1.%d.%d - u%d [01/Dec/2026:10:%02d:00 +0000] "GET %s HTTP/1.1" %s %d "-" %s'
                     % (i % 7, i % 250, i % 3, i % 60, path, code, rng.randint(0, 9999), agent))
    return "\n".join(lines) + "\n", counts


def expected(counts):
    return "".join("%s %d\n" % (c, n) for c, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))


def check(ctx):
    rng = random.Random(404)
    for n in (1, 40, 300, 1500):
        text, counts = gen(rng, n)
        ws = ctx.fresh({"hidden.log": text})
        res = ctx.run(["/bin/sh", "codes.sh", "hidden.log"], ws, timeout=30)
        if res.stdout != expected(counts):
            raise vharness.Fail("codes.sh on a hidden %d-line log printed %r..., want %r..."
                                % (n, res.stdout[:120], expected(counts)[:120]))
    t1, c1 = gen(rng, 50)
    t2, c2 = gen(rng, 70)
    ws = ctx.fresh({"one.log": t1, "two words.log": t2})
    res = ctx.run(["/bin/sh", "codes.sh", "one.log", "two words.log"], ws, timeout=30)
    if res.stdout != expected(c1 + c2):
        raise vharness.Fail("two files: printed %r..." % res.stdout[:120])
    res = ctx.run(["/bin/sh", "codes.sh"], ws, stdin=t1, timeout=30)
    if res.stdout != expected(c1):
        raise vharness.Fail("stdin: printed %r..." % res.stdout[:120])
    return 1.0, "hidden logs, several files and stdin counted correctly"


if __name__ == "__main__":
    vharness.main(check, __file__)
