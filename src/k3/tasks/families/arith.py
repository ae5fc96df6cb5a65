"""The ``arith`` family (domain ``general``, no tools): add or subtract two numbers of 2-3 digits.

An instance is "What is 482 + 39?" or a one-sentence word problem with the same numbers,
ending "Reply with the number only.". The task allows no tools and sets ``answer = "answer.txt"``:
the model's final reply is submitted as answer.txt, and the hidden verifier accepts exactly the
number (whitespace stripped). Subtractions never go below zero.

The scripted solver, one turn whose content is the number:

- ``low``: the equation only ("482 + 39 = 521.");
- ``high``: column by column from the right in a fixed format: the digits of both numbers (the
  shorter padded with zeros), one line per column ``x+y+carry = v, write d, carry c`` (or
  ``x-y-borrow = v, [add 10,] write d, borrow b``), the written digits left to right, the result;
- ``max``: ``high``, then a check by the inverse operation worked the same way, ending "which
  matches".
"""

from __future__ import annotations

import random

from k3.tasks.families.base import Family, TaskFiles, answer_verifier

__all__ = ["Arith", "columns"]

NAMES = ("Ana", "Ben", "Mia", "Leo", "Zoe", "Sam")
THINGS = ("apples", "stamps", "coins", "books", "shells")
WORD = {  # (question, why the operation)
    "+": [("{n} has {a} {t} and gets {b} more. How many {t} does {n} have now?", "Gets more means add"),
          ("A shop sold {a} {t} on Monday and {b} on Tuesday. How many {t} did it sell in all?",
           "In all means add")],
    "-": [("{n} has {a} {t} and gives away {b}. How many {t} are left?", "Gives away means subtract"),
          ("A shop had {a} {t} and sold {b}. How many {t} does it have left?", "Sold means subtract")],
}
ANSWER_FILE = "answer.txt"


def columns(a: int, b: int, op: str) -> tuple[list[str], int]:
    """The column-by-column lines of ``a op b`` (module doc) and the result (``a >= b`` for -)."""
    width = max(len(str(a)), len(str(b)))
    da, db = str(a).zfill(width), str(b).zfill(width)
    lines = [f"Digits: {' '.join(da)} and {' '.join(db)}."]
    carry, written = 0, []
    for i in reversed(range(width)):
        x, y = int(da[i]), int(db[i])
        if op == "+":
            v = x + y + carry
            lines.append(f"{x}+{y}+{carry} = {v}, write {v % 10}, carry {v // 10}.")
            written.append(v % 10)
            carry = v // 10
        else:
            v = x - y - carry
            if v < 0:
                lines.append(f"{x}-{y}-{carry} = {v}, add 10, write {v + 10}, borrow 1.")
                written.append(v + 10)
                carry = 1
            else:
                lines.append(f"{x}-{y}-{carry} = {v}, write {v}, borrow 0.")
                written.append(v)
                carry = 0
    if op == "+" and carry:
        lines.append("The last carry 1 is the first digit.")
        written.append(1)
    digits = written[::-1]
    lines.append(f"Written digits: {' '.join(map(str, digits))}.")
    value = int("".join(map(str, digits)))
    if len(str(value)) != len(digits):
        lines.append(f"Without leading zeros: {value}.")
    if value != (a + b if op == "+" else a - b) or carry and op == "-":
        raise AssertionError(f"columns({a}, {b}, {op!r}) gave {value}")  # a bug here, never bad input
    return lines, value


class Arith(Family):
    name = "arith"
    domain = "general"
    about = "add or subtract two numbers of 2-3 digits; the reply is the answer (no tools)"

    def build(self, seed: int, rng: random.Random) -> TaskFiles:
        da, db = rng.choice((2, 3)), rng.choice((2, 3))
        a, b = rng.randint(10 ** (da - 1), 10 ** da - 1), rng.randint(10 ** (db - 1), 10 ** db - 1)
        op = rng.choice("+-")
        if op == "-" and a < b:
            a, b = b, a
        answer = a + b if op == "+" else a - b
        if rng.random() < 0.6:
            question, why = f"What is {a} {op} {b}?", None
        else:
            text, why = rng.choice(WORD[op])
            question = text.format(n=rng.choice(NAMES), t=rng.choice(THINGS), a=a, b=b)
        spec = {"a": a, "b": b, "op": op, "answer": answer, "question": question, "why": why}
        wrong = {"reasoning": f"{a} {op} {b} = {answer + 1}.", "content": str(answer + 1)}
        return TaskFiles(kind="data", goal=question + " Reply with the number only.", submit=[ANSWER_FILE],
                         tools=[], spec=spec, workspace={}, answer=ANSWER_FILE,
                         verifier=answer_verifier(ANSWER_FILE, [str(answer)]),
                         hacks={"off-by-one": ("a reply one more than the answer", [wrong])},
                         budget={"steps": 1, "tokens": 4000, "wall_seconds": 30, "submissions": 1})

    def turns(self, spec: dict, effort: str) -> list[dict]:
        a, b, op, ans = spec["a"], spec["b"], spec["op"], spec["answer"]
        if effort == "low":
            return [{"reasoning": f"{a} {op} {b} = {ans}.", "content": str(ans)}]
        lines = [f"{spec['why']}: {a} {op} {b}."] if spec["why"] else []
        lines.append(f"{a} {op} {b} column by column from the right.")
        lines += columns(a, b, op)[0]
        lines.append(f"So {a} {op} {b} = {ans}.")
        if effort == "max":
            inv = "-" if op == "+" else "+"
            lines.append(f"Check: {ans} {inv} {b} should give {a}.")
            lines += columns(ans, b, inv)[0]
            lines.append(f"So {ans} {inv} {b} = {a}, which matches. The answer is {ans}.")
        return [{"reasoning": "\n".join(lines), "content": str(ans)}]

    def expected_outputs(self, spec: dict, effort: str) -> list[str | None]:
        return []  # no tool calls
