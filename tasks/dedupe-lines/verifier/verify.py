"""Hidden verifier for dedupe-lines: random inputs (spaces, tabs, backslashes, no final newline, several files)."""
import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import vharness  # noqa: E402


def ref(text):
    seen, out = set(), []
    for line in text.split("\n")[:-1] if text.endswith("\n") else text.split("\n"):
        if line not in seen:
            seen.add(line)
            out.append(line + "\n")
    return "".join(out) if text else ""


def check(ctx):
    rng = random.Random(31337)
    words = ["x", "y", " x", "x ", "a\tb", "a b", "-n", "\\t", "back\\slash", "", "*", "$HOME", "' q", "10", "9", "ÿ é"]
    cases = []
    for n in (1, 3, 10, 60, 400):
        lines = [rng.choice(words) for _ in range(n)]
        text = "\n".join(lines) + rng.choice(["\n", ""])
        if text == "":
            text = "\n"
        cases.append(text)
    for i, text in enumerate(cases):
        ws = ctx.fresh({"in%d.txt" % i: text})
        res = ctx.run(["/bin/sh", "dedupe.sh", "in%d.txt" % i], ws)
        if res.stdout != ref(text):
            raise vharness.Fail("dedupe.sh on hidden input %d printed %r..., want %r..." % (i, res.stdout[:80], ref(text)[:80]))
        res = ctx.run(["/bin/sh", "dedupe.sh"], ws, stdin=text)
        if res.stdout != ref(text):
            raise vharness.Fail("dedupe.sh reading stdin (input %d) printed %r..." % (i, res.stdout[:80]))
    a, b = "p\nq\np\n", "q\nr\n"
    ws = ctx.fresh({"a.txt": a, "b c.txt": b})
    res = ctx.run(["/bin/sh", "dedupe.sh", "a.txt", "b c.txt"], ws)
    if res.stdout != "p\nq\nr\n":
        raise vharness.Fail("dedupe.sh a.txt 'b c.txt' printed %r, want 'p\\nq\\nr\\n'" % res.stdout)
    res = ctx.run(["/bin/sh", "dedupe.sh"], ws, stdin="")
    if res.stdout != "":
        raise vharness.Fail("empty input printed %r" % res.stdout)
    return 1.0, "%d hidden inputs, stdin and several files correct" % len(cases)


if __name__ == "__main__":
    vharness.main(check, __file__)
