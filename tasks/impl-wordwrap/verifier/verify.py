"""Hidden verifier for impl-wordwrap: random texts and widths against a reference wrapper."""
import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import vharness  # noqa: E402

DRIVER = r'''
from textfmt import wrap
out = []
for text, width in payload:
    try:
        out.append(["ok", wrap(text, width)])
    except Exception as e:
        out.append(["err", type(e).__name__])
emit(out)
'''


def ref(text, width):
    if isinstance(width, bool) or not isinstance(width, int) or width < 1:
        return ["err", "ValueError"]
    paragraphs, cur = [], []
    for line in text.split("\n"):
        words = line.split()
        if words:
            cur.extend(words)
        elif cur:
            paragraphs.append(cur)
            cur = []
    if cur:
        paragraphs.append(cur)
    out = []
    for p in paragraphs:
        if out:
            out.append("")
        line = ""
        for word in p:
            if not line and len(word) <= width:
                line = word
            elif line and len(line) + 1 + len(word) <= width:
                line += " " + word
            else:
                if line:
                    out.append(line)
                while len(word) > width:
                    out.append(word[:width])
                    word = word[width:]
                line = word
        if line:
            out.append(line)
    return ["ok", out]


def check(ctx):
    rng = random.Random(73)
    words = ["a", "to", "the", "word", "longer", "encyclopaedia", "x" * 23, "naïve", "–", "12345"]
    cases = []
    for _ in range(150):
        parts = []
        for _ in range(rng.randint(0, 30)):
            parts.append(rng.choice(words))
            parts.append(rng.choice([" ", " ", "  ", "\t", "\n", "\n\n", " \n \n", "\n\n\n"]))
        cases.append(["".join(parts), rng.choice([1, 2, 3, 5, 8, 13, 20, 40, 80])])
    cases += [["", 10], ["x", -1], ["x", 2.0], ["x", True], ["abc", 1], ["\n\nhello\n\n", 3]]
    got = ctx.results(DRIVER, ctx.fresh(), cases)
    for (text, width), g in zip(cases, got):
        want = ref(text, width)
        if g != want:
            raise vharness.Fail("wrap(%r, %r) gave %r, want %r" % (text[:80], width, str(g)[:200], str(want)[:200]))
    return 1.0, "%d hidden texts correct" % len(cases)


if __name__ == "__main__":
    vharness.main(check, __file__)
