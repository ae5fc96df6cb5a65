"""Harness randomization for training (SPEC §7.3): seeded, recorded, reversible.

``HarnessConfig.from_seed(seed)`` draws, with ``random.Random(seed)`` (the same on every machine and
Python process), one choice per axis:

- tool names: each canonical tool gets one of ``TOOL_ALIASES[tool]``;
- argument schemas: each canonical argument gets one of ``ARG_ALIASES[arg]``;
- prompt template: one of ``PROMPT_TEMPLATES``;
- context strategy: one of ``CONTEXT_STRATEGIES`` (see ``k3.agent.harness.compact``);
- memory: on or off (a harness-kept notes message of files changed and submissions used).

``seed=None`` is the canonical harness (no renaming, template 0, ``drop_old_tool_outputs``,
memory off). The config is recorded in the trajectory (``as_dict``) and rebuilt from it
(``from_dict``); ``to_model`` / ``from_model`` translate a call between canonical and model-side
names, so renaming never reaches task files, the policy or the trajectory's canonical record.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from k3.errors import ConfigError

__all__ = ["HarnessConfig", "TOOL_ALIASES", "ARG_ALIASES", "PROMPT_TEMPLATES", "ANSWER_PROMPTS", "ANSWER_NOTE",
           "CONTEXT_STRATEGIES"]

TOOL_ALIASES = {
    "shell": ["shell", "bash", "run_command", "terminal", "exec_shell"],
    "read": ["read", "read_file", "view_file", "cat_file"],
    "write": ["write", "write_file", "create_file", "save_file"],
    "edit": ["edit", "str_replace", "edit_file", "replace_in_file"],
    "list": ["list", "ls", "list_dir", "list_files"],
    "submit": ["submit", "finish", "submit_work", "hand_in"],
    "screenshot": ["screenshot", "take_screenshot", "render_page", "capture_page"],
}
ARG_ALIASES = {
    "command": ["command", "cmd", "script"],
    "timeout": ["timeout", "timeout_s", "seconds"],
    "path": ["path", "file", "file_path", "filename"],
    "content": ["content", "text", "data"],
    "old": ["old", "old_str", "search", "find"],
    "new": ["new", "new_str", "replace", "replacement"],
    "width": ["width", "w", "viewport_width"],
    "height": ["height", "h", "viewport_height"],
}
# Axes added after the first release: drawn after all the others (so that every seed keeps the
# draw it had), and named canonically in a recorded config that predates them.
LATER_TOOLS = ("screenshot",)
LATER_ARGS = ("width", "height")
PROMPT_TEMPLATES = [
    "You are an autonomous software agent working in a sandbox. Your working directory is {workdir}.\n"
    "Use the tools to complete the task, then call {submit} to hand in your work. You may submit at "
    "most {submissions} times; the work is judged by a hidden verifier.",
    "You operate inside an isolated Linux sandbox (cwd {workdir}). Solve the task below with the tools "
    "provided. When done, call {submit} (at most {submissions} submissions). Hidden tests decide the score.",
    "Task environment: a sandboxed shell and file tools, working directory {workdir}.\n"
    "Work step by step, check your work with the visible checks, and finish with {submit}. "
    "Submissions allowed: {submissions}. A separate, hidden verifier grades the result.",
    "You are a careful engineer. Files live in {workdir}. Make the change the task asks for, verify it, "
    "and call {submit}; you have {submissions} submission(s). Grading is done by tests you cannot see.",
]
# A task with ``answer`` and no tools (k3.tasks.format): the reply is the submission.
ANSWER_PROMPTS = [
    "Answer the task. Your final reply after your reasoning is the answer; a hidden verifier grades it.",
    "Solve the task below. Reply with the answer only; it is graded by a hidden verifier.",
    "Think it through, then reply with just the answer. A separate, hidden verifier grades it.",
    "You are a careful solver. Give the final answer as your reply; tests you cannot see grade it.",
]
# ... and with tools: appended to the tool template.
ANSWER_NOTE = "A reply without a tool call ends the task: it is saved as {answer} and submitted."
CONTEXT_STRATEGIES = ["drop_old_tool_outputs", "truncate_tool_outputs", "sliding_window"]


@dataclass
class HarnessConfig:
    seed: int | None = None
    tool_names: dict[str, str] = field(default_factory=lambda: {k: k for k in TOOL_ALIASES})
    arg_names: dict[str, str] = field(default_factory=lambda: {k: k for k in ARG_ALIASES})
    template: int = 0
    context_strategy: str = "drop_old_tool_outputs"
    memory: bool = False

    @classmethod
    def from_seed(cls, seed: int | None) -> "HarnessConfig":
        if seed is None:
            return cls()
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ConfigError(f"harness seed must be an int, got {seed!r}")
        rng = random.Random(seed)
        tools = {k: rng.choice(v) for k, v in TOOL_ALIASES.items() if k not in LATER_TOOLS}
        args = {k: rng.choice(v) for k, v in ARG_ALIASES.items() if k not in LATER_ARGS}
        template, strategy, memory = rng.randrange(len(PROMPT_TEMPLATES)), rng.choice(CONTEXT_STRATEGIES), \
            rng.random() < 0.5
        tools.update((k, rng.choice(TOOL_ALIASES[k])) for k in LATER_TOOLS)
        args.update((k, rng.choice(ARG_ALIASES[k])) for k in LATER_ARGS)
        return cls(seed, {k: tools[k] for k in TOOL_ALIASES}, {k: args[k] for k in ARG_ALIASES}, template, strategy,
                   memory)

    def as_dict(self) -> dict:
        return {"seed": self.seed, "tool_names": dict(self.tool_names), "arg_names": dict(self.arg_names),
                "template": self.template, "context_strategy": self.context_strategy, "memory": self.memory}

    @classmethod
    def from_dict(cls, d: dict) -> "HarnessConfig":
        extra = set(d) - {"seed", "tool_names", "arg_names", "template", "context_strategy", "memory"}
        if extra:
            raise ConfigError(f"harness config: unknown key(s) {sorted(extra)}")
        tools, args = dict(d["tool_names"]), dict(d["arg_names"])
        for k in LATER_TOOLS:
            tools.setdefault(k, k)
        for k in LATER_ARGS:
            args.setdefault(k, k)
        cfg = cls(d["seed"], tools, args, d["template"], d["context_strategy"], d["memory"])
        cfg.check()
        return cfg

    def check(self) -> None:
        if set(self.tool_names) != set(TOOL_ALIASES) or len(set(self.tool_names.values())) != len(TOOL_ALIASES):
            raise ConfigError(f"harness tool_names must rename each of {sorted(TOOL_ALIASES)} to a distinct name")
        if set(self.arg_names) != set(ARG_ALIASES):
            raise ConfigError(f"harness arg_names must rename each of {sorted(ARG_ALIASES)}")
        if self.context_strategy not in CONTEXT_STRATEGIES:
            raise ConfigError(f"harness context_strategy must be one of {CONTEXT_STRATEGIES}, "
                              f"got {self.context_strategy!r}")
        if not 0 <= self.template < len(PROMPT_TEMPLATES):
            raise ConfigError(f"harness template must be in [0, {len(PROMPT_TEMPLATES)})")

    # ------------------------------------------------------------------ translation
    def to_model(self, name: str, args: dict) -> tuple[str, dict]:
        return self.tool_names.get(name, name), {self.arg_names.get(k, k): v for k, v in args.items()}

    def from_model(self, name: str, args: dict) -> tuple[str | None, dict]:
        """Canonical (name, args) of a model-side call; name None when no tool has that name.
        Argument keys the schema does not know are kept as given (the tool then refuses them)."""
        back = {v: k for k, v in self.tool_names.items()}
        arg_back = {v: k for k, v in self.arg_names.items()}
        return back.get(name), {arg_back.get(k, k): v for k, v in args.items()}

    def system_prompt(self, workdir: str, submissions: int, answer: str | None = None,
                      tools: tuple[str, ...] | None = None) -> str:
        """The system prompt of template ``self.template``. ``answer`` (a task's answer file) with no
        ``tools`` allowed is the answer prompt; with tools, the tool prompt plus ``ANSWER_NOTE``."""
        if answer is not None and tools is not None and not tools:
            return ANSWER_PROMPTS[self.template]
        text = PROMPT_TEMPLATES[self.template].format(workdir=workdir, submit=self.tool_names["submit"],
                                                      submissions=submissions)
        return text if answer is None else text + "\n" + ANSWER_NOTE.format(answer=answer)
