"""Autonomous Execution Tasks (SPEC §7.2): a task is a directory; ``load_task(dir) -> Task``.

Layout and ``task.toml`` are specified in docs/AGENTS.md (the task format): ``task.toml``,
``workspace/`` (copied to /workspace), ``checks/`` (visible, copied to /workspace/checks),
``verifier/verify.py`` (hidden: never inside the agent's sandbox), ``solution/solve.json`` and
``hacks/*.json`` (Scripted transcripts with ``expect_reward``). Unknown keys anywhere in
``task.toml`` or a transcript are refused with an error naming the key; omitted tables take the
defaults below; ``id``, ``kind`` and ``goal`` are required.

``answer = "answer.txt"`` (optional) makes the reply itself a submission: when the episode ends
because the model answered without calling a tool, that last visible content is written to
``/workspace/answer.txt`` and submitted like a ``submit`` call (same budget, same clean-room
verifier; ``k3.rl.rollout``). The value is a relative file path without ``..`` that one of the
``submit`` globs selects. Only a task with ``answer`` may allow no tools (``[tools] allowed = []``).
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

from k3.agent.harness import Budget
from k3.agent.tools import check_arguments
from k3.errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

__all__ = ["Task", "TaskBudget", "Transcript", "load_task", "load_transcript", "find_tasks", "validate_task",
           "KINDS", "TOOLS"]

KINDS = ("python", "shell", "data")
TOOLS = ("shell", "read", "write", "edit", "list", "submit")
MAX_SUBMIT_FILE = 1 << 20
_ID = re.compile(r"[a-z0-9][a-z0-9._-]{0,63}")
_TOP = {"id", "kind", "goal", "submit", "answer", "budget", "scoring", "tools", "verifier"}
_TABLES = {
    "budget": {"steps": 40, "tokens": 32000, "wall_seconds": 120, "submissions": 3},
    "scoring": {"use": "best"},
    "tools": {"allowed": list(TOOLS)},
    "verifier": {"timeout": 60, "network": False},
}


TaskBudget = Budget  # one budget type: the task's [budget] table is what the harness enforces


@dataclass
class Transcript:
    path: Path
    description: str
    expect_reward: float
    turns: list[dict]
    needs_sandbox: bool = False   # informational: only meaningful in a real sandbox (k3 always uses one)


@dataclass
class Task:
    root: Path
    id: str
    kind: str
    goal: str
    submit: list[str]
    budget: TaskBudget
    scoring: str
    allowed_tools: list[str]
    verifier_timeout: float
    verifier_network: bool
    solution: Transcript | None = None
    hacks: list[Transcript] = field(default_factory=list)
    answer: str | None = None  # the file the final reply is submitted as (module doc), or None

    @property
    def workspace(self) -> Path:
        return self.root / "workspace"

    @property
    def checks(self) -> Path:
        return self.root / "checks"

    @property
    def verifier(self) -> Path:
        return self.root / "verifier"

    def digest(self) -> str:
        """sha256 over every file of the task (path + bytes), so a trajectory names what it ran."""
        h = hashlib.sha256()
        for p in sorted(self.root.rglob("*")):
            if p.is_file() and "__pycache__" not in p.parts:
                h.update(str(p.relative_to(self.root)).encode() + b"\0" + p.read_bytes() + b"\0")
        return h.hexdigest()


def _num(table: str, key: str, v, lo: float, integer: bool = True):
    ok = not isinstance(v, bool) and (isinstance(v, int) if integer else isinstance(v, (int, float)))
    if not ok or v < lo:
        kind = "an int" if integer else "a number"
        raise ConfigError(f"task.toml: [{table}] {key} must be {kind} >= {lo}, got {v!r}")
    return v


def _tables(raw: dict, where: Path) -> dict:
    for k in raw:
        if k not in _TOP:
            raise ConfigError(f"{where}: unknown key {k!r} (allowed: {sorted(_TOP)})")
    out = {}
    for name, defaults in _TABLES.items():
        t = raw.get(name, {})
        if not isinstance(t, dict):
            raise ConfigError(f"{where}: [{name}] must be a table")
        for k in t:
            if k not in defaults:
                raise ConfigError(f"{where}: unknown key {name}.{k!r} (allowed: {sorted(defaults)})")
        out[name] = {**defaults, **t}
    return out


def load_task(root: str | Path, transcripts: bool = True) -> Task:
    root = Path(root)
    toml = root / "task.toml"
    if not toml.is_file():
        raise ConfigError(f"{toml}: no task.toml (a task is a directory with task.toml)")
    try:
        raw = tomllib.loads(toml.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{toml}: not valid TOML: {e}") from None
    t = _tables(raw, toml)
    for k in ("id", "kind", "goal"):
        if not isinstance(raw.get(k), str) or not raw[k].strip():
            raise ConfigError(f"{toml}: {k!r} is required (a non-empty string)")
    if raw["id"] != root.resolve().name or not _ID.fullmatch(raw["id"]):
        raise ConfigError(f"{toml}: id {raw['id']!r} must equal the directory name {root.resolve().name!r} "
                          "(lowercase letters, digits, . _ -)")
    if raw["kind"] not in KINDS:
        raise ConfigError(f"{toml}: kind must be one of {KINDS}, got {raw['kind']!r}")
    submit = raw.get("submit")
    if not isinstance(submit, list) or not submit or not all(isinstance(g, str) and g for g in submit):
        raise ConfigError(f"{toml}: submit must be a non-empty list of globs")
    for g in submit:
        if g.startswith("/") or ".." in g.split("/"):
            raise ConfigError(f"{toml}: submit glob {g!r} must be relative to /workspace without '..'")
    b = t["budget"]
    budget = TaskBudget(_num("budget", "steps", b["steps"], 1), _num("budget", "tokens", b["tokens"], 1),
                        _num("budget", "wall_seconds", b["wall_seconds"], 0.1, integer=False),
                        _num("budget", "submissions", b["submissions"], 1))
    if t["scoring"]["use"] not in ("best", "last"):
        raise ConfigError(f"{toml}: [scoring] use must be 'best' or 'last', got {t['scoring']['use']!r}")
    answer = _answer(raw.get("answer"), submit, toml)
    allowed = t["tools"]["allowed"]
    if not isinstance(allowed, list) or any(a not in TOOLS for a in allowed) or len(set(allowed)) != len(allowed):
        raise ConfigError(f"{toml}: [tools] allowed must be a list of distinct tools of {TOOLS}, got {allowed!r}")
    if not allowed and answer is None:
        raise ConfigError(f"{toml}: [tools] allowed = [] needs 'answer' (without tools, only the reply "
                          "can be submitted)")
    v = t["verifier"]
    if not isinstance(v["network"], bool):
        raise ConfigError(f"{toml}: [verifier] network must be true or false")
    if v["network"]:
        raise ConfigError(f"{toml}: [verifier] network = true is not supported (verifiers run offline)")
    for d in ("workspace", "verifier"):
        if not (root / d).is_dir():
            raise ConfigError(f"{root / d}: missing (a task needs {d}/)")
    if not (root / "verifier" / "verify.py").is_file():
        raise ConfigError(f"{root / 'verifier' / 'verify.py'}: missing (the verifier entry)")
    if (root / "verifier" / "vharness.py").exists():
        raise ConfigError(f"{root / 'verifier' / 'vharness.py'}: provided by k3 at verification time; "
                          "remove the task's own copy")
    task = Task(root, raw["id"], raw["kind"], raw["goal"], list(submit), budget, t["scoring"]["use"],
                list(allowed), _num("verifier", "timeout", v["timeout"], 1, integer=False), False,
                answer=answer)
    if transcripts:
        sol = root / "solution" / "solve.json"
        task.solution = load_transcript(sol) if sol.is_file() else None
        task.hacks = [load_transcript(p) for p in sorted((root / "hacks").glob("*.json"))]
    return task


def _answer(value, submit: list[str], toml: Path) -> str | None:
    """The ``answer`` field checked (module doc): None, or a relative path a submit glob selects."""
    if value is None:
        return None
    from k3.tasks.verify import glob_regex

    parts = value.split("/") if isinstance(value, str) else []
    if not parts or value.startswith("/") or any(p in ("", ".", "..") for p in parts) or "\\" in value:
        raise ConfigError(f"{toml}: answer must be a relative file path without '..' (e.g. \"answer.txt\"), "
                          f"got {value!r}")
    if not any(glob_regex(g).match(value) for g in submit):
        raise ConfigError(f"{toml}: answer {value!r} is not selected by any submit glob {submit} "
                          "(the verifier would never see it)")
    return value


def load_transcript(path: str | Path) -> Transcript:
    """A Scripted transcript; every tool call is checked against the canonical tool schema."""
    path = Path(path)
    try:
        d = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as e:
        raise ConfigError(f"{path}: not valid JSON: {e}") from None
    if not isinstance(d, dict):
        raise ConfigError(f"{path}: a transcript is a JSON object")
    for k in d:
        if k not in ("description", "expect_reward", "turns", "needs_sandbox"):
            raise ConfigError(f"{path}: unknown key {k!r}")
    if not isinstance(d.get("needs_sandbox", False), bool):
        raise ConfigError(f"{path}: needs_sandbox must be true or false")
    turns = d.get("turns")
    if not isinstance(turns, list):
        raise ConfigError(f"{path}: 'turns' must be a list")
    er = d.get("expect_reward", 1.0)
    if isinstance(er, bool) or not isinstance(er, (int, float)) or not 0 <= er <= 1:
        raise ConfigError(f"{path}: expect_reward must be a number in [0, 1]")
    for i, t in enumerate(turns):
        if not isinstance(t, dict):
            raise ConfigError(f"{path}: turns[{i}] must be an object")
        for k in t:
            if k not in ("reasoning", "content", "tool_calls"):
                raise ConfigError(f"{path}: turns[{i}]: unknown key {k!r}")
        for j, c in enumerate(t.get("tool_calls", [])):
            if not isinstance(c, dict) or set(c) - {"name", "arguments"} or "name" not in c:
                raise ConfigError(f"{path}: turns[{i}].tool_calls[{j}] must be {{name, arguments}}")
            problem = check_arguments(c["name"], c.get("arguments", {}))
            if problem:
                raise ConfigError(f"{path}: turns[{i}].tool_calls[{j}]: {problem}")
    return Transcript(path, str(d.get("description", "")), float(er), turns, d.get("needs_sandbox", False))


def find_tasks(root: str | Path) -> list[Path]:
    """Task directories under ``root`` (``root`` itself when it holds a task.toml), sorted."""
    root = Path(root)
    if (root / "task.toml").is_file():
        return [root]
    found = sorted(p.parent for p in root.glob("*/task.toml"))
    if not found:
        raise ConfigError(f"{root}: no task directories (*/task.toml)")
    return found


def validate_task(root: str | Path) -> Task:
    """``load_task`` plus the checks a suite needs: a solution transcript and at least one hack."""
    task = load_task(root)
    if task.solution is None:
        raise ConfigError(f"{task.root / 'solution' / 'solve.json'}: missing (the reference solution)")
    if not task.hacks:
        raise ConfigError(f"{task.root / 'hacks'}: no hack transcripts (at least one *.json)")
    return task
