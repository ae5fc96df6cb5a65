"""The ``code`` family (domain ``coding_agent``; tools write, shell, submit): implement one small
function in solution.py from a one-sentence spec and an example; the hidden verifier runs it on
hidden inputs (in vharness children) and compares with the expected results, all or nothing.

Templates: ``sum_digits``, ``reverse_words``, ``count_vowels``, ``max_of``, ``is_palindrome``,
``count_evens``; each instance draws one, one of its names, the example and the hidden inputs.

The scripted solver writes solution.py and submits, then replies. ``low``: no reasoning;
``high``: the plan and the example worked by hand; ``max``: the same, then it runs the function
on the example (``python3 -c ...``), reads the real output (``expected_outputs``), and submits
only after it matched.
"""

from __future__ import annotations

import json
import random

from k3.tasks.families.base import Family, TaskFiles, shell_output

__all__ = ["Code", "TEMPLATES"]

WORDS = ("red", "sun", "cat", "blue", "tree", "stone", "river", "apple", "moon", "bird", "Echo", "Ideal",
         "Opera", "Umbra", "AIR")
PALINDROMES = ("level", "noon", "radar", "kayak", "refer", "abba", "stats", "x")


def _phrase(r):
    return " ".join(r.choice(WORDS) for _ in range(r.randint(1, 5)))


def _nums(r):
    return [r.randint(-50, 99) for _ in range(r.randint(1, 7))]


def _word(r):
    return r.choice(PALINDROMES) if r.random() < 0.4 else r.choice(WORDS).lower()


# name -> {names, arg, spec, body (the solution's return expression), broken, ref, draw, edge, plan, trace}
TEMPLATES = {
    "sum_digits": {
        "names": ("sum_digits", "digit_sum"), "arg": "n",
        "spec": "returns the sum of the decimal digits of the int n >= 0",
        "body": "sum(int(d) for d in str(n))", "broken": "sum(int(d) for d in str(n)[1:])",
        "ref": lambda n: sum(int(d) for d in str(n)), "draw": lambda r: r.randint(10, 99999),
        "edge": [0, 7, 1000, 99999],
        "plan": "{f}(n) must add the digits of n. str(n) gives the digits as characters, int() makes each "
                "a number again and sum() adds them.",
        "trace": lambda x, y: f"For {x}: {' + '.join(str(x))} = {y}."},
    "reverse_words": {
        "names": ("reverse_words", "flip_words"), "arg": "s",
        "spec": "returns the words of the string s in reverse order, joined by single spaces",
        "body": "\" \".join(s.split()[::-1])", "broken": "s[::-1]",
        "ref": lambda s: " ".join(s.split()[::-1]), "draw": _phrase,
        "edge": ["", "one", "  two  spaces "],
        "plan": "{f}(s) must reverse the order of the words. s.split() gives the words, [::-1] reverses the "
                "list and \" \".join puts single spaces between them.",
        "trace": lambda x, y: f"For {x!r}: the words {x.split()} reversed give {y!r}."},
    "count_vowels": {
        "names": ("count_vowels", "vowel_count"), "arg": "s",
        "spec": "returns how many letters of the string s are vowels (a, e, i, o, u, upper or lower case)",
        "body": "sum(1 for c in s.lower() if c in \"aeiou\")", "broken": "sum(1 for c in s if c in \"aeiou\")",
        "ref": lambda s: sum(1 for c in s.lower() if c in "aeiou"), "draw": _phrase,
        "edge": ["", "xyz", "AEIOU", "Ideal Opera"],
        "plan": "{f}(s) must count vowels in either case. s.lower() makes every letter lower case, then "
                "count the characters that are in \"aeiou\".",
        "trace": lambda x, y: f"For {x!r}: the vowels are {[c for c in x if c.lower() in 'aeiou']}, {y} of them."},
    "max_of": {
        "names": ("max_of", "largest"), "arg": "xs",
        "spec": "returns the largest number in the non-empty list xs",
        "body": "max(xs)", "broken": "xs[-1]",
        "ref": max, "draw": _nums, "edge": [[5], [-3, -9, -4], [2, 9, 1], [7, 7, 3]],
        "plan": "{f}(xs) must return the largest element. The built-in max() does exactly that.",
        "trace": lambda x, y: f"For {x}: the largest is {y}."},
    "is_palindrome": {
        "names": ("is_palindrome", "reads_same"), "arg": "s",
        "spec": "returns True if the string s reads the same forwards and backwards, else False",
        "body": "s == s[::-1]", "broken": "s[0] == s[-1]",
        "ref": lambda s: s == s[::-1], "draw": _word, "edge": ["", "a", "abca", "noon", "ab"],
        "plan": "{f}(s) must compare s with itself reversed. s[::-1] is s backwards; == gives True or False.",
        "trace": lambda x, y: f"For {x!r}: backwards it is {x[::-1]!r}, so {y}."},
    "count_evens": {
        "names": ("count_evens", "even_count"), "arg": "xs",
        "spec": "returns how many numbers in the list xs are even",
        "body": "sum(1 for x in xs if x % 2 == 0)", "broken": "sum(1 for x in xs if x % 2 == 1)",
        "ref": lambda xs: sum(1 for x in xs if x % 2 == 0), "draw": _nums,
        "edge": [[], [1, 3], [0, -2, 5], [2, 4, 6]],
        "plan": "{f}(xs) must count the even numbers. A number x is even when x % 2 == 0; sum 1 for each.",
        "trace": lambda x, y: f"For {x}: the even ones are {[v for v in x if v % 2 == 0]}, {y} of them."},
}
SOLUTION = "solution.py"


def source(name: str, arg: str, body: str) -> str:
    return f"def {name}({arg}):\n    return {body}\n"


class Code(Family):
    name = "code"
    domain = "coding_agent"
    about = "implement one small function in solution.py from a spec; hidden inputs check it"

    def build(self, seed: int, rng: random.Random) -> TaskFiles:
        template = rng.choice(sorted(TEMPLATES))
        t = TEMPLATES[template]
        fname = rng.choice(t["names"])
        example = t["draw"](rng)
        while template == "max_of" and example.index(max(example)) == len(example) - 1:
            example = t["draw"](rng)  # an example where the broken "last element" would be wrong
        cases = [example, *t["edge"], *(t["draw"](rng) for _ in range(8))]
        want = [t["ref"](x) for x in cases]
        out = t["ref"](example)
        spec = {"template": template, "function": fname, "arg": t["arg"], "example": example,
                "example_out": out, "solution": source(fname, t["arg"], t["body"])}
        goal = (f"Write solution.py with a function {fname}({t['arg']}) that {t['spec']}. "
                f"Example: {fname}({example!r}) == {out!r}. Then submit.")
        broken = source(fname, t["arg"], t["broken"])
        hack = [{"reasoning": "", "content": "", "tool_calls": [
            {"name": "write", "arguments": {"path": SOLUTION, "content": broken}},
            {"name": "submit", "arguments": {}}]}]
        return TaskFiles(kind="python", goal=goal, submit=[SOLUTION], tools=["write", "shell", "submit"],
                         spec=spec, workspace={}, verifier=_verifier(fname, [[x] for x in cases], want),
                         hacks={"broken-function": (f"a plausible bug: return {t['broken']}", hack)},
                         budget={"steps": 8, "tokens": 8000, "wall_seconds": 60, "submissions": 2})

    def turns(self, spec: dict, effort: str) -> list[dict]:
        t = TEMPLATES[spec["template"]]
        f, x, y = spec["function"], spec["example"], spec["example_out"]
        write = {"name": "write", "arguments": {"path": SOLUTION, "content": spec["solution"]}}
        submit = {"name": "submit", "arguments": {}}
        final = {"reasoning": "" if effort == "low" else "Submitted.", "content": f"solution.py defines {f}."}
        if effort == "low":
            return [{"reasoning": "", "content": "", "tool_calls": [write, submit]}, final]
        think = t["plan"].format(f=f) + " " + t["trace"](x, y)
        if effort == "high":
            return [{"reasoning": think, "content": "", "tool_calls": [write, submit]}, final]
        run = {"name": "shell", "arguments": {"command": _run_example(f, x)}}
        return [{"reasoning": think + " Write it, then run it on the example before submitting.", "content": "",
                 "tool_calls": [write, run]},
                {"reasoning": f"It printed {y!r}, and the example says {y!r}: it works. Submit.", "content": "",
                 "tool_calls": [submit]}, final]

    def expected_outputs(self, spec: dict, effort: str) -> list[str | None]:
        if effort != "max":
            return [None, None]  # write, submit
        return [None, shell_output(repr(spec["example_out"]) + "\n"), None]


def _run_example(f: str, x) -> str:
    return f"python3 -c \"from solution import {f}; print(repr({f}({x!r})))\""


def _verifier(fname: str, cases: list, want: list) -> str:
    return f'''"""Hidden verifier: {fname} on hidden inputs, in a vharness child; all must match."""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import vharness  # noqa: E402

NAME = {fname!r}
CASES = json.loads({json.dumps(cases)!r})
WANT = json.loads({json.dumps(want)!r})
DRIVER = r"""
import solution
f = getattr(solution, payload["name"], None)
out = []
for args in payload["cases"]:
    try:
        out.append(["ok", f(*args)])
    except Exception as e:
        out.append(["err", type(e).__name__])
emit(out)
"""


def check(ctx):
    got = ctx.results(DRIVER, ctx.fresh(), {{"name": NAME, "cases": CASES}})
    if not isinstance(got, list) or len(got) != len(CASES):
        raise vharness.Fail("the driver gave no result per case")
    for args, g, w in zip(CASES, got, WANT):
        if json.dumps(g) != json.dumps(["ok", w]):
            raise vharness.Fail("%s(%s) gave %s, want %s"
                                % (NAME, json.dumps(args)[1:-1], json.dumps(g), json.dumps(w)))
    return 1.0, "all %d hidden cases pass" % len(CASES)


if __name__ == "__main__":
    vharness.main(check, __file__)
'''
