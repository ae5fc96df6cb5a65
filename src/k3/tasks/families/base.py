"""What every task family shares: seeds and splits, efforts, and writing a task directory.

A family turns a seed into a complete task directory (docs/AGENTS.md, the task format) and knows
the scripted solution of each instance at each effort. ``Family.generate(seed, out_dir)`` writes
``out_dir/<family>-<seed>/`` deterministically: the same seed gives byte-identical files on every
machine (``random.Random`` seeded with a string, no clock, no hash order). Next to the task's own
files it writes ``family.json`` (family, seed, split, domain and the instance's spec, which holds
the answer: it is never copied into a sandbox, like ``verifier/``).

Seeds are ints >= 0. **Split rule**: seeds below ``HELDOUT_START`` (1,000,000) are training
seeds, seeds from it on are held out; ``split_of(seed)`` says which, and every generated task
records its split. Held-out tasks are fresh draws of the same templates (new numbers, files,
names), never a seed a training run has used.

A subclass provides ``build(seed, rng) -> TaskFiles`` (the instance), ``turns(spec, effort)``
(the scripted solver: Scripted transcript turns, canonical tool names) and
``expected_outputs(spec, effort)`` (for each tool call of those turns, the tool result text the
turns assume, or None when it does not matter): the solver's later turns are written from the
spec, so a synthesized episode is consistent only if the real tool results are these.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path

from k3.errors import ConfigError
from k3.tasks.format import DOMAINS  # noqa: F401 - the families' domains (re-exported)

__all__ = ["Family", "TaskFiles", "HELDOUT_START", "SPLITS", "DOMAINS", "EFFORTS", "META_FILE",
           "split_of", "check_seed", "check_effort", "answer_verifier", "shell_output"]

HELDOUT_START = 1_000_000
SPLITS = ("train", "heldout")
EFFORTS = ("low", "high", "max")  # == k3.data.chat.EFFORTS (checked by the tests)
META_FILE = "family.json"
FORMAT = 1  # of family.json


def check_seed(seed) -> int:
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ConfigError(f"seed must be an int >= 0, got {seed!r}")
    return seed


def split_of(seed: int) -> str:
    """``"train"`` for seeds below ``HELDOUT_START``, ``"heldout"`` from it on."""
    return "train" if check_seed(seed) < HELDOUT_START else "heldout"


def check_effort(effort) -> str:
    if effort not in EFFORTS:
        raise ConfigError(f"effort must be one of {', '.join(EFFORTS)}, got {effort!r}")
    return effort


def shell_output(text: str, code: int = 0) -> str:
    """The shell tool's result text for a command that printed ``text`` (k3.agent.tools)."""
    return f"exit code {code}\n{text}"


@dataclass
class TaskFiles:
    """One instance, as the family built it (written by ``Family.generate``)."""

    kind: str                          # task.toml kind
    goal: str
    submit: list[str]
    tools: list[str]
    spec: dict                         # everything the solver needs (JSON); holds the answer
    workspace: dict[str, str]          # relative path -> text
    verifier: str                      # verifier/verify.py
    hacks: dict[str, tuple[str, list[dict]]]  # name -> (description, turns); each must score 0
    answer: str | None = None          # task.toml answer (the reply is submitted as this file)
    budget: dict = field(default_factory=lambda: {"steps": 8, "tokens": 8000, "wall_seconds": 60,
                                                  "submissions": 1})
    scoring: str = "last"
    verifier_timeout: int = 30
    image: str = "default"             # task.toml image (k3.tasks.format): "browser" for a headless Chromium


class Family(ABC):
    """Base of a task family (module doc). Subclasses set ``name``, ``domain`` and ``about``."""

    name = ""
    domain = ""
    about = ""
    solution_effort = "high"  # the effort of solution/solve.json
    vision = False            # True: its tool results carry images (only a model with a vision tower runs it)

    # ------------------------------------------------------------------ each family's own
    @abstractmethod
    def build(self, seed: int, rng: random.Random) -> TaskFiles:
        """The instance of ``seed``, drawn only from ``rng``."""

    @abstractmethod
    def turns(self, spec: dict, effort: str) -> list[dict]:
        """The scripted solver's transcript turns for ``spec`` at ``effort``."""

    @abstractmethod
    def expected_outputs(self, spec: dict, effort: str) -> list[str | None]:
        """Per tool call of ``turns(spec, effort)``, the result text they assume (None: any)."""

    # ------------------------------------------------------------------ shared
    def task_id(self, seed: int) -> str:
        return f"{self.name}-{check_seed(seed)}"

    def instance(self, seed: int) -> TaskFiles:
        check_seed(seed)
        return self.build(seed, random.Random(f"k3-family:{self.name}:{seed}"))

    def spec(self, seed: int) -> dict:
        return self.instance(seed).spec

    def solve(self, task, effort: str) -> list[dict]:
        """The scripted solver's turns for ``task`` (a task directory with family.json, or a spec
        dict) at ``effort``: the transcript format ``k3.agent.providers.Scripted`` replays."""
        return self.turns(self.load_spec(task), check_effort(effort))

    def check_outputs(self, spec: dict, effort: str, outputs: list[str]) -> str | None:
        """None when the real tool results ``outputs`` (in call order) are the ones the solver's turns
        assume (``expected_outputs``), else what differs: such an episode is not consistent data."""
        want = self.expected_outputs(spec, effort)
        if len(outputs) != len(want):
            return f"{len(outputs)} tool results, the solver made {len(want)} calls"
        for i, (got, exp) in enumerate(zip(outputs, want)):
            if exp is not None and got != exp:
                return f"tool result {i} is {got[:80]!r}, the solver assumed {exp[:80]!r}"
        return None

    def load_spec(self, task) -> dict:
        if isinstance(task, dict):
            return task
        meta = read_meta(task)
        if meta["family"] != self.name:
            raise ConfigError(f"{task}: a {meta['family']!r} task, not {self.name!r}")
        return meta["spec"]

    def meta(self, seed: int, spec: dict) -> dict:
        return {"family": self.name, "seed": seed, "split": split_of(seed), "domain": self.domain,
                "format": FORMAT, "spec": spec}

    def generate(self, seed: int, out_dir, overwrite: bool = False) -> Path:
        """Write ``out_dir/<family>-<seed>/`` (module doc) and return it. An existing non-empty
        directory is refused, or with ``overwrite`` replaced when it is a generated task."""
        target = self.target(seed, out_dir, overwrite)
        files = self.instance(seed)
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        tmp = out_dir / f".{target.name}.tmp{os.getpid()}"
        if tmp.exists():
            shutil.rmtree(tmp)
        try:
            self._write(tmp, target.name, seed, files)
            if target.exists():
                shutil.rmtree(target) if target.is_dir() else target.unlink()
            os.replace(tmp, target)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp)
        return target

    def target(self, seed: int, out_dir, overwrite: bool = False) -> Path:
        """``out_dir/<family>-<seed>``, checked as ``generate`` would (so a caller can check every
        seed before writing any)."""
        target = Path(out_dir) / self.task_id(seed)
        if target.exists() and (not target.is_dir() or any(target.iterdir())):
            if not overwrite:
                raise ConfigError(f"{target}: exists and is not empty (--overwrite replaces a generated task)")
            if not (target / META_FILE).is_file():
                raise ConfigError(f"{target}: not a generated task (no {META_FILE}); refusing to replace it")
        return target

    def _write(self, d: Path, task_id: str, seed: int, f: TaskFiles) -> None:
        (d / "workspace").mkdir(parents=True)
        for rel, text in sorted(f.workspace.items()):
            _put(d / "workspace" / rel, text)
        _put(d / "verifier" / "verify.py", f.verifier)
        _put(d / "task.toml", task_toml(task_id, f))
        _put(d / META_FILE, _json(self.meta(seed, f.spec)))
        sol = {"description": f"{self.name} scripted solver, effort {self.solution_effort}",
               "expect_reward": 1.0, "turns": self.turns(f.spec, self.solution_effort)}
        _put(d / "solution" / "solve.json", _json(sol))
        for name, (desc, turns) in sorted(f.hacks.items()):
            _put(d / "hacks" / f"{name}.json", _json({"description": desc, "expect_reward": 0.0, "turns": turns}))


def read_meta(task_dir) -> dict:
    """``family.json`` of a generated task directory, checked."""
    path = Path(task_dir) / META_FILE
    if not path.is_file():
        raise ConfigError(f"{path}: missing (not a task generated by a family)")
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as e:
        raise ConfigError(f"{path}: not valid JSON: {e}") from None
    need = {"family", "seed", "split", "domain", "format", "spec"}
    if not isinstance(meta, dict) or set(meta) != need:
        raise ConfigError(f"{path}: must hold exactly {sorted(need)}")
    if meta["format"] != FORMAT:
        raise ConfigError(f"{path}: format {meta['format']!r}, this k3 reads {FORMAT}")
    return meta


def task_toml(task_id: str, f: TaskFiles) -> str:
    q = lambda v: json.dumps(v, ensure_ascii=False)  # noqa: E731 - JSON strings and arrays are TOML
    lines = [f"id = {q(task_id)}", f"kind = {q(f.kind)}", f"goal = {q(f.goal)}", f"submit = {q(f.submit)}"]
    if f.answer is not None:
        lines.append(f"answer = {q(f.answer)}")
    if f.image != "default":
        lines.append(f"image = {q(f.image)}")
    lines += ["", "[budget]"] + [f"{k} = {v}" for k, v in f.budget.items()]
    lines += ["", "[scoring]", f"use = {q(f.scoring)}", "", "[tools]", f"allowed = {q(f.tools)}",
              "", "[verifier]", f"timeout = {f.verifier_timeout}", "network = false", ""]
    return "\n".join(lines)


def answer_verifier(path: str, accept: list[str]) -> str:
    """A verify.py (on k3's vharness) that reads ``path`` from the workspace as data and gives 1.0
    when its text, stripped, is one of ``accept``."""
    return f'''"""Hidden verifier: {path}, stripped, must be the answer."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import vharness  # noqa: E402

ACCEPT = {json.dumps(accept, ensure_ascii=False)}


def check(ctx):
    got = vharness.read_text(ctx.workspace, {path!r}).strip()
    if got not in ACCEPT:
        raise vharness.Fail("wrong answer in {path}: %r" % got[:60])
    return 1.0, "correct answer"


if __name__ == "__main__":
    vharness.main(check, __file__)
'''


def _json(obj) -> str:
    return json.dumps(obj, ensure_ascii=False, indent=1, sort_keys=True) + "\n"


def _put(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(text.encode("utf-8"))
