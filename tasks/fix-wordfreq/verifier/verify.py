"""Hidden verifier for fix-wordfreq: other texts, default K, K=0, K beyond the vocabulary, odd file names."""
import os
import random
import re
import sys
from collections import Counter

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import vharness  # noqa: E402


def ref(text, k):
    counts = Counter(w.lower() for w in re.findall(r"[A-Za-z]+", text))
    rows = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:k]
    return "".join("%s %d\n" % kv for kv in rows)


def gen(rng, n):
    words = ["alpha", "Beta", "GAMMA", "delta", "it's", "x", "Ab", "aB", "z", "naïve", "e-mail", "a1b"]
    seps = [" ", "  ", "\n", ", ", ". ", "\t", " -- ", "!\n", ";", "\n\n"]
    return "".join(rng.choice(words) + rng.choice(seps) for _ in range(n))


def check(ctx):
    rng = random.Random(55)
    cases = 0
    for n in (5, 50, 400):
        text = gen(rng, n)
        ws = ctx.fresh({"my text.txt": text})
        for k in (None, "0", "1", "4", "100"):
            args = ["my text.txt"] + ([k] if k is not None else [])
            res = ctx.run(["/bin/sh", "wordfreq.sh"] + args, ws)
            want = ref(text, 10 if k is None else int(k))
            if res.stdout != want:
                raise vharness.Fail("wordfreq.sh %r printed %r..., want %r..." % (args, res.stdout[:100], want[:100]))
            cases += 1
    return 1.0, "%d hidden runs correct" % cases


if __name__ == "__main__":
    vharness.main(check, __file__)
