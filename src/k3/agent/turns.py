"""One agent step as data (SPEC §7.3): ``AgentTurn(visible, reasoning, tool_calls, tool_results,
provider, metadata)``, and the history -> chat messages view a provider is sent.

Reasoning is opaque per provider: ``history_messages(..., provider_id=P)`` sends a turn's
``reasoning`` back (as ``reasoning_content``) only when the turn came from ``P``. Turns made by
another provider are sent as one user message that lists their visible text, tool calls and
results (no reasoning) and asks for a re-plan: a provider switch starts a re-plan instead of
pretending the new model thought the old model's thoughts. Reasoning is never shown to a user
unless asked (``AgentTurn.show(reasoning=True)``).

A tool result may carry images (``ToolResult.images``: data URLs, e.g. the ``screenshot`` tool's
PNG): its tool message's content is then a list of parts, the output as a ``text`` part and one
``image_url`` part per image (``k3.data.chat`` renders them as media blocks); a result without
images is the plain output string, as it always was.

Compaction may put one elided-history marker first in a view (``elided_turn``): a turn that is
not a model turn but stands for the oldest turns it dropped whole; it is sent as one user
message, ``ELIDED_NOTE`` with the count of turns and of tool calls per (model-side) tool name.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Callable

__all__ = ["AgentTurn", "ToolCall", "ToolResult", "history_messages", "elided_turn", "REPLAN_NOTE",
           "ELIDED_NOTE"]

REPLAN_NOTE = ("The steps below were taken by another model; its private reasoning is not available. "
               "Re-plan from the current state.")
ELIDED_NOTE = ("The {turns} oldest turns of this episode were dropped to save context ({calls}); the "
               "workspace keeps what they did.")


@dataclass
class ToolCall:
    id: str
    name: str                  # canonical tool name (shell, read, write, edit, list, submit)
    arguments: dict

    def as_dict(self) -> dict:
        return {"id": self.id, "name": self.name, "arguments": self.arguments}


@dataclass
class ToolResult:
    call_id: str
    name: str
    output: str                # what the model is shown
    error: bool = False        # refused by policy, bad arguments, or a failed operation
    meta: dict = field(default_factory=dict)   # exit_code, timed_out, truncated, denied_by, ...
    dropped: bool = False      # compaction replaced the output in what is sent (kept in the trajectory)
    images: list[str] = field(default_factory=list)   # data: URLs the model is shown after the output

    def as_dict(self) -> dict:
        d = {"call_id": self.call_id, "name": self.name, "output": self.output, "error": self.error,
             "meta": self.meta}
        if self.images:
            d["images"] = list(self.images)
        return d

    def content(self) -> str | list[dict]:
        """The tool message's content: the output, or with images a text part and the image parts."""
        if not self.images:
            return self.output
        return [{"type": "text", "text": self.output}] + [{"type": "image_url", "image_url": {"url": u}}
                                                          for u in self.images]


@dataclass
class AgentTurn:
    visible: str
    reasoning: str | None
    tool_calls: list[ToolCall]
    tool_results: list[ToolResult]
    provider: str              # the provider id that produced the turn
    metadata: dict = field(default_factory=dict)   # usage, finish_reason, elapsed, ...

    def as_dict(self) -> dict:
        return {"visible": self.visible, "reasoning": self.reasoning, "provider": self.provider,
                "tool_calls": [c.as_dict() for c in self.tool_calls],
                "tool_results": [r.as_dict() for r in self.tool_results], "metadata": self.metadata}

    @classmethod
    def from_dict(cls, d: dict) -> "AgentTurn":
        return cls(d["visible"], d.get("reasoning"), [ToolCall(**c) for c in d["tool_calls"]],
                   [ToolResult(**r) for r in d["tool_results"]], d["provider"], d.get("metadata", {}))

    def show(self, reasoning: bool = False) -> str:
        """What a user sees of the turn: visible text and tool calls; reasoning only when asked."""
        parts = [f"[thinking] {self.reasoning}"] if reasoning and self.reasoning else []
        parts += [self.visible] if self.visible else []
        parts += [f"-> {c.name} {json.dumps(c.arguments, ensure_ascii=False)[:200]}" for c in self.tool_calls]
        return "\n".join(parts)


Namer = Callable[[str, dict], tuple[str, dict]]   # canonical (name, args) -> model-side (name, args)


def _identity(name: str, args: dict) -> tuple[str, dict]:
    return name, args


def elided_turn(turns: list[AgentTurn]) -> AgentTurn:
    """The marker a compacted view holds in place of ``turns`` (oldest first), which it dropped whole."""
    calls: dict[str, int] = {}
    for t in turns:
        for c in t.tool_calls:
            calls[c.name] = calls.get(c.name, 0) + 1
    return AgentTurn("", None, [], [], "", {"elided": {"turns": len(turns), "calls": calls}})


def history_messages(system: str, user: str, turns: list[AgentTurn], provider_id: str,
                     to_model: Namer = _identity, extra: list[dict] | None = None) -> list[dict]:
    """OpenAI-style messages for ``provider_id``: system, the goal, then each turn. A run of turns
    from another provider becomes one user message with ``REPLAN_NOTE`` (no reasoning)."""
    msgs = [{"role": "system", "content": system}, {"role": "user", "content": user}]
    foreign: list[str] = []
    for t in turns:
        if t.metadata.get("elided"):
            e = t.metadata["elided"]
            calls = ", ".join(f"{to_model(k, {})[0]} x{v}" for k, v in e["calls"].items()) or "no tool calls"
            msgs.append({"role": "user", "content": ELIDED_NOTE.format(turns=e["turns"], calls=calls)})
            continue
        if t.provider != provider_id:
            foreign.append(_describe(t, to_model))
            continue
        if foreign:
            msgs.append({"role": "user", "content": REPLAN_NOTE + "\n" + "\n".join(foreign)})
            foreign = []
        m: dict = {"role": "assistant", "content": t.visible}
        if t.reasoning is not None:
            m["reasoning_content"] = t.reasoning
        if t.tool_calls:
            calls = []
            for c in t.tool_calls:
                name, args = to_model(c.name, c.arguments)
                calls.append({"id": c.id, "type": "function",
                              "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}})
            m["tool_calls"] = calls
        msgs.append(m)
        for r in t.tool_results:
            msgs.append({"role": "tool", "tool_call_id": r.call_id, "content": r.content()})
    if foreign:
        msgs.append({"role": "user", "content": REPLAN_NOTE + "\n" + "\n".join(foreign)})
    return msgs + list(extra or [])


def _describe(t: AgentTurn, to_model: Namer) -> str:
    lines = [f"- said: {t.visible}"] if t.visible else []
    results = {r.call_id: r for r in t.tool_results}
    for c in t.tool_calls:
        r = results.get(c.id)
        name, args = to_model(c.name, c.arguments)
        seen = "" if r is None or not r.images else f" [{len(r.images)} image(s) not shown]"
        lines.append(f"- called {name} {json.dumps(args, ensure_ascii=False)}"
                     + (f" -> {r.output}{seen}" if r is not None else ""))
    return "\n".join(lines)
