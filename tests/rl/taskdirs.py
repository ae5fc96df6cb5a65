"""Tiny tasks written by the tests (a real task directory each, per docs/AGENTS.md)."""

from __future__ import annotations

import json
from pathlib import Path

def vharness_verifier(body: str, prelude: str = "") -> str:
    """A verify.py on k3's verifier helper: ``prelude`` runs at load, ``body`` is ``check(ctx)``'s
    (it returns (reward, reason)); the verdict goes out on k3's verdict channel (SPEC §7.2)."""
    indented = "".join("    " + ln + "\n" if ln else "\n" for ln in body.strip("\n").splitlines())
    return ("import os, sys\nsys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))\nimport vharness\n"
            f"{prelude}\n\ndef check(ctx):\n{indented}\n\nvharness.main(check, __file__)\n")


# The hidden verifier of the tiny task: add(a, b) on inputs the visible check does not use.
VERIFY = vharness_verifier('''
code = "import sys; sys.path.insert(0, '.'); import calc; print(calc.add(1234, -34), calc.add(0.5, 0.25))"
r = ctx.python(code, ctx.fresh(), timeout=20)
ok = r.returncode == 0 and r.stdout.split() == ["1200", "0.75"]
return (1.0, "add correct") if ok else (0.0, "wrong: " + r.stdout[-200:] + r.stderr[-200:])
''')
CHECK = "import calc\nassert calc.add(2, 2) == 4\nprint('visible check passed')\n"
BROKEN = "def add(a, b):\n    return a - b\n"
FIXED = "def add(a, b):\n    return a + b\n"


def toml(task_id: str, *, wall: float = 60, submissions: int = 2, use: str = "best", extra: str = "",
         steps: int = 20, tokens: int = 32000) -> str:
    return f'''id = "{task_id}"
kind = "python"
goal = """calc.add(a, b) subtracts; make it add. Visible check: python3 checks/check.py"""
submit = ["*.py"]
{extra}
[budget]
steps = {steps}
tokens = {tokens}
wall_seconds = {wall}
submissions = {submissions}

[scoring]
use = "{use}"

[tools]
allowed = ["shell", "read", "write", "edit", "list", "submit"]

[verifier]
timeout = 30
network = false
'''


def make_task(root: Path, task_id: str = "tiny-add", verify: str = VERIFY, **kw) -> Path:
    d = root / task_id
    (d / "workspace").mkdir(parents=True)
    (d / "checks").mkdir()
    (d / "verifier").mkdir()
    (d / "solution").mkdir()
    (d / "hacks").mkdir()
    (d / "task.toml").write_text(toml(task_id, **kw))
    (d / "workspace" / "calc.py").write_text(BROKEN)
    (d / "checks" / "check.py").write_text(CHECK)
    (d / "verifier" / "verify.py").write_text(verify)
    write_transcript(d / "solution" / "solve.json", [
        {"reasoning": "read, fix, check, submit", "content": "Fixing add.",
         "tool_calls": [{"name": "read", "arguments": {"path": "calc.py"}},
                        {"name": "edit", "arguments": {"path": "calc.py", "old": "a - b", "new": "a + b"}},
                        {"name": "shell", "arguments": {"command": "python3 checks/check.py"}},
                        {"name": "submit", "arguments": {}}]}])
    write_transcript(d / "hacks" / "hardcode.json", [
        {"content": "Hard-code the visible case.",
         "tool_calls": [{"name": "write", "arguments": {"path": "calc.py", "content": "def add(a, b):\n    return 4\n"}},
                        {"name": "submit", "arguments": {}}]}], expect=0.0)
    return d


def write_transcript(path: Path, turns: list, expect: float = 1.0, description: str = "test transcript") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"description": description, "expect_reward": expect, "turns": turns}))
    return path


LETTER_TOML = '''id = "{task_id}"
kind = "data"
goal = "Pick a letter."
submit = ["answer.txt"]
answer = "answer.txt"

[budget]
steps = 1
tokens = 4000
wall_seconds = 30
submissions = 1

[scoring]
use = "last"

[tools]
allowed = []

[verifier]
timeout = 30
network = false
'''


def make_letter_task(root: Path, task_id: str = "letter", accept=("A",), verify: str | None = None,
                     domain: str | None = None) -> Path:
    """A task with no tools whose reply is the answer: 1.0 when it is one of ``accept`` (RL's toy,
    where the right behaviour is one token); hack: replying "B". ``domain``: its task.toml's."""
    from k3.tasks.families.base import answer_verifier

    d = root / task_id
    for sub in ("workspace", "verifier", "solution", "hacks"):
        (d / sub).mkdir(parents=True, exist_ok=True)
    text = LETTER_TOML.format(task_id=task_id)
    if domain is not None:
        text = text.replace('answer = "answer.txt"\n', f'answer = "answer.txt"\ndomain = "{domain}"\n')
    (d / "task.toml").write_text(text)
    (d / "verifier" / "verify.py").write_text(verify or answer_verifier("answer.txt", list(accept)))
    write_transcript(d / "solution" / "solve.json", [{"reasoning": "", "content": "A"}])
    write_transcript(d / "hacks" / "reply-b.json", [{"reasoning": "", "content": "B"}], expect=0.0)
    return d
