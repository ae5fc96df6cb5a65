"""The ``files`` family (domain ``general_agent``; tools shell, write, submit): answer a question
about small generated files with a shell command, write the answer to answer.txt and submit.

Templates (one per instance, the files a dozen short lines at most):

- ``count``: log.txt of ``HH:MM LEVEL message`` lines; how many lines contain a level
  (``grep -c ERROR log.txt``; the check: ``grep ERROR log.txt | wc -l``);
- ``lines``: names.txt, one name a line; how many lines (``wc -l < names.txt``; ``grep -c '' names.txt``);
- ``value``: config.txt of ``key=value`` lines; the value of one key
  (``grep '^port=' config.txt | cut -d= -f2``; ``sed -n 's/^port=//p' config.txt``);
- ``find``: notes/ with 3-5 files, one holding a code word; which file (``grep -l WORD notes/*``,
  answer the bare file name; the check: ``grep -c WORD notes/<that file>``).

The scripted solver runs the command, reads the real result (the synthesis checks it is the
one the later turns assume, ``expected_outputs``), writes answer.txt and submits, then replies:
``low`` says next to nothing; ``high`` says what it looks for, why the command answers it and
what the result means; ``max`` does that and re-counts with a second, different command before
writing the answer.
"""

from __future__ import annotations

import random

from k3.tasks.families.base import Family, TaskFiles, answer_verifier, shell_output

__all__ = ["Files"]

LEVELS = ("INFO", "WARN", "ERROR")
MESSAGES = ("disk full", "user login", "cache miss", "job done", "retry send", "port open", "file saved",
            "timeout hit", "backup ok", "link down")
NAMES = ("ada", "bob", "cara", "dan", "eve", "finn", "gus", "hana", "ivan", "jo", "kim", "lea")
KEYS = {"port": lambda r: str(r.randint(1000, 9999)), "host": lambda r: r.choice(("alpha", "beta", "gamma")),
        "user": lambda r: r.choice(NAMES), "mode": lambda r: r.choice(("fast", "safe", "debug")),
        "retries": lambda r: str(r.randint(1, 9)), "color": lambda r: r.choice(("red", "blue", "green")),
        "level": lambda r: r.choice(("low", "mid", "high")), "limit": lambda r: str(r.randint(10, 500))}
NOTE_FILES = ("todo.txt", "ideas.txt", "plan.txt", "shop.txt", "misc.txt")
NOTE_WORDS = ("milk", "call mom", "fix bike", "read book", "pay rent", "walk dog", "buy bread", "water plants")
CODE_WORDS = ("PURPLE", "COBALT", "MANGO", "ZEPHYR", "QUARTZ", "NEBULA")
ANSWER_FILE = "answer.txt"
TAIL = " Write the answer to answer.txt and submit."


def _count(rng: random.Random) -> dict:
    level = rng.choice(LEVELS)
    while True:
        rows = [(rng.choice(LEVELS), rng.choice(MESSAGES)) for _ in range(rng.randint(6, 12))]
        n = sum(lv == level for lv, _ in rows)
        if n >= 1:
            break
    text = "".join(f"{9 + i // 6:02d}:{(i * 7) % 60:02d} {lv} {m}\n" for i, (lv, m) in enumerate(rows))
    return {"files": {"log.txt": text}, "question": f"How many lines of log.txt contain {level}?",
            "answer": str(n), "cmd": f"grep -c {level} log.txt", "check": f"grep {level} log.txt | wc -l",
            "out": str(n), "check_out": str(n), "accept": [str(n)],
            "plan": f"I need the number of lines in log.txt that contain {level}. grep -c prints that count.",
            "read": f"grep printed {n}, so {n} lines contain {level}."}


def _lines(rng: random.Random) -> dict:
    names = [rng.choice(NAMES) for _ in range(rng.randint(4, 15))]
    n = len(names)
    return {"files": {"names.txt": "".join(x + "\n" for x in names)},
            "question": "How many lines does names.txt have?", "answer": str(n), "cmd": "wc -l < names.txt",
            "check": "grep -c '' names.txt", "out": str(n), "check_out": str(n), "accept": [str(n)],
            "plan": "I need the number of lines in names.txt. wc -l counts lines.",
            "read": f"wc printed {n}, so names.txt has {n} lines."}


def _value(rng: random.Random) -> dict:
    keys = rng.sample(sorted(KEYS), rng.randint(4, 7))
    values = {k: KEYS[k](rng) for k in keys}
    key = rng.choice(keys)
    v = values[key]
    return {"files": {"config.txt": "".join(f"{k}={values[k]}\n" for k in keys)},
            "question": f"What is the value of {key} in config.txt?", "answer": v,
            "cmd": f"grep '^{key}=' config.txt | cut -d= -f2", "check": f"sed -n 's/^{key}=//p' config.txt",
            "out": v, "check_out": v, "accept": [v],
            "plan": f"I need the value of {key} in config.txt. grep finds the {key}= line and cut keeps "
                    "what follows the =.",
            "read": f"It printed {v}, so {key} is {v}."}


def _find(rng: random.Random) -> dict:
    names = sorted(rng.sample(NOTE_FILES, rng.randint(3, 5)))
    word = rng.choice(CODE_WORDS)
    hit = rng.choice(names)
    files = {}
    for name in names:
        lines = rng.sample(NOTE_WORDS, rng.randint(2, 4))
        if name == hit:
            lines.insert(rng.randint(0, len(lines)), f"code {word}")
        files[f"notes/{name}"] = "".join(x + "\n" for x in lines)
    return {"files": files, "question": f"Which file in notes/ contains the word {word}? "
                                        "The answer is its name, like todo.txt.",
            "answer": hit, "cmd": f"grep -l {word} notes/*", "check": f"grep -c {word} notes/{hit}",
            "out": f"notes/{hit}", "check_out": "1", "accept": [hit, f"notes/{hit}"],
            "plan": f"I need the file in notes/ that contains {word}. grep -l prints the names of matching files.",
            "read": f"grep printed notes/{hit}, so the file is {hit}."}


TEMPLATES = {"count": _count, "lines": _lines, "value": _value, "find": _find}


class Files(Family):
    name = "files"
    domain = "general_agent"
    about = "count, find or extract in small files with a shell command; write answer.txt and submit"

    def build(self, seed: int, rng: random.Random) -> TaskFiles:
        template = rng.choice(sorted(TEMPLATES))
        inst = TEMPLATES[template](rng)
        spec = {"template": template, **{k: v for k, v in inst.items() if k not in ("files", "accept")}}
        wrong = _wrong(inst["answer"])
        hack = [{"reasoning": "", "tool_calls": [{"name": "write", "arguments": {"path": ANSWER_FILE,
                                                                                  "content": wrong + "\n"}},
                                                  {"name": "submit", "arguments": {}}]}]
        return TaskFiles(kind="shell", goal=inst["question"] + TAIL, submit=[ANSWER_FILE],
                         tools=["shell", "write", "submit"], spec=spec, workspace=inst["files"],
                         verifier=answer_verifier(ANSWER_FILE, inst["accept"]),
                         hacks={"wrong-answer": (f"writes {wrong!r} without looking", hack)})

    def turns(self, spec: dict, effort: str) -> list[dict]:
        ans = spec["answer"]
        run = {"name": "shell", "arguments": {"command": spec["cmd"]}}
        write_submit = [{"name": "write", "arguments": {"path": ANSWER_FILE, "content": ans + "\n"}},
                        {"name": "submit", "arguments": {}}]
        final = {"reasoning": "" if effort == "low" else "The answer is submitted.",
                 "content": f"The answer is {ans}."}
        if effort == "low":
            return [{"reasoning": "", "content": "", "tool_calls": [run]},
                    {"reasoning": "", "content": "", "tool_calls": write_submit}, final]
        first = {"reasoning": spec["plan"], "content": "", "tool_calls": [run]}
        if effort == "high":
            return [first, {"reasoning": f"{spec['read']} I write {ans} to answer.txt and submit.", "content": "",
                            "tool_calls": write_submit}, final]
        return [first,
                {"reasoning": f"{spec['read']} Check it with another command: {spec['check']}", "content": "",
                 "tool_calls": [{"name": "shell", "arguments": {"command": spec["check"]}}]},
                {"reasoning": f"The check printed {spec['check_out']}, which agrees, so the answer is {ans}. "
                              f"I write {ans} to answer.txt and submit.",
                 "content": "", "tool_calls": write_submit}, final]

    def expected_outputs(self, spec: dict, effort: str) -> list[str | None]:
        first = [shell_output(spec["out"] + "\n")]
        check = [shell_output(spec["check_out"] + "\n")] if effort == "max" else []
        return first + check + [None, None]  # write, submit


def _wrong(answer: str) -> str:
    """A plausible wrong answer: the number off by one, or another word."""
    if answer.isdigit():
        return str(int(answer) + 1)
    return answer + "x"
