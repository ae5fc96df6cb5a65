"""The agent loop (SPEC §7.3): provider turn -> policy -> tools -> results, inside budgets.

``Harness(provider, toolbox, policy, cfg, budget, goal, submit, record).run() -> EpisodeResult``.
Each step sends the history (compacted to ``context_tokens``) to the provider, takes its reply as
an ``AgentTurn`` and runs the tool calls in order; each call first passes the policy chain
(``Policy.decide``), denied calls get an error result naming the reason. ``submit`` is delegated
to the ``submit`` callback (the rollout collects the files; the reward is not shown to the agent).

Budgets (``Budget``): ``steps`` = tool calls made (denied ones count); ``tokens`` = prompt +
completion tokens the provider reports, summed over the episode; ``wall_seconds`` = the whole
episode (shell timeouts are clamped to the time left; an episode past it ends with status
``wall_time_exceeded``, which the rollout scores 0); ``submissions`` = accepted submit calls.
``answer`` (a task's answer file, k3.tasks.format) only changes the system prompt
(``HarnessConfig.system_prompt``); submitting the final reply is the rollout's job.

Compaction (``compact``; the strategy is a harness-randomization axis): the context estimate is
``ceil(chars / 4)`` over the messages, an image part counted as ``IMAGE_TOKENS`` instead of its
data URL's characters. Over ``context_tokens``, tool outputs are dropped oldest
first (``drop_old_tool_outputs``), or first cut to a head and tail of 200 characters each and then
dropped (``truncate_tool_outputs``), or dropped for every turn but the last ``keep_recent`` at once
(``sliding_window``); a dropped output's images are dropped with it; the last ``keep_recent`` turns are never touched and reasoning is never
dropped by any strategy. Only what is sent is compacted; the trajectory keeps every output whole,
and each turn record's ``metadata.sent_tokens`` is the estimate of what was sent for it.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from dataclasses import dataclass
from typing import Callable

from k3.agent.policy import Policy, PolicyContext
from k3.agent.providers import ProviderError, ProviderRequest
from k3.agent.randomize import HarnessConfig
from k3.agent.tools import ToolBox, tool_schemas
from k3.agent.turns import AgentTurn, ToolCall, ToolResult, history_messages
from k3.tasks.format import Budget

__all__ = ["EpisodeResult", "Harness", "compact", "estimate_tokens", "IMAGE_TOKENS"]


@dataclass
class EpisodeResult:
    status: str                # completed | wall_time_exceeded | step_budget | token_budget | provider_error
    turns: list[AgentTurn]
    steps: int
    tokens: int
    elapsed: float
    submissions: int
    detail: str = ""


IMAGE_TOKENS = 1024  # the estimate of one image part (a 640x480 screenshot is a few hundred vision tokens)


def estimate_tokens(messages: list[dict]) -> int:
    chars, images = 0, 0
    for m in messages:
        c = m.get("content")
        if isinstance(c, list) and any(isinstance(p, dict) and p.get("type") == "image_url" for p in c):
            images += sum(1 for p in c if isinstance(p, dict) and p.get("type") == "image_url")
            m = {**m, "content": [p for p in c if not (isinstance(p, dict) and p.get("type") == "image_url")]}
        chars += len(json.dumps(m, ensure_ascii=False))
    return math.ceil(chars / 4) + images * IMAGE_TOKENS


def _with_output(r: ToolResult, text: str, keep_images: bool = True) -> ToolResult:
    return dataclasses.replace(r, output=text, dropped=True, images=list(r.images) if keep_images else [])


def compact(turns: list[AgentTurn], strategy: str, fits: Callable[[list[AgentTurn]], bool],
            keep_recent: int = 2) -> list[AgentTurn]:
    """Copies of ``turns`` with old tool outputs shortened until ``fits(view)`` (see module doc)."""
    view = [dataclasses.replace(t, tool_results=list(t.tool_results)) for t in turns]
    old = range(max(0, len(view) - keep_recent))
    if fits(view):
        return view

    def drop(i, j):
        r = view[i].tool_results[j]
        if not r.dropped or not r.output.startswith("[output dropped"):
            stub = f"[output dropped to save context: {len(r.output)} chars" + \
                (f", {len(r.images)} image(s)]" if r.images else "]")
            view[i].tool_results[j] = _with_output(r, stub, keep_images=False)

    if strategy == "sliding_window":
        for i in old:
            for j in range(len(view[i].tool_results)):
                drop(i, j)
        return view
    if strategy == "truncate_tool_outputs":
        for i in old:
            for j, r in enumerate(view[i].tool_results):
                if len(r.output) > 400:
                    view[i].tool_results[j] = _with_output(r, f"{r.output[:200]}\n[... cut ...]\n{r.output[-200:]}")
        if fits(view):
            return view
    for i in old:  # oldest first
        for j in range(len(view[i].tool_results)):
            drop(i, j)
            if fits(view):
                return view
    return view


class Harness:
    def __init__(self, provider, toolbox: ToolBox, policy: Policy, cfg: HarnessConfig, budget: Budget,
                 goal: str, submit: Callable[[], str], record: Callable[[str, dict], None] = lambda k, d: None,
                 allowed_tools: tuple[str, ...] = ("shell", "read", "write", "edit", "list", "submit"),
                 context_tokens: int = 16384, temperature: float = 0.0, effort: str | None = None,
                 max_tokens: int | None = 1024, seed: int | None = None, clock: Callable[[], float] = time.monotonic,
                 answer: str | None = None):
        self.provider, self.tools, self.policy, self.cfg, self.budget = provider, toolbox, policy, cfg, budget
        self.goal, self.submit_fn, self.record = goal, submit, record
        self.allowed = tuple(allowed_tools)
        self.context_tokens, self.temperature, self.effort = context_tokens, temperature, effort
        self.max_tokens, self.seed, self.clock = max_tokens, seed, clock
        self.system = cfg.system_prompt(toolbox.workdir, budget.submissions, answer=answer, tools=self.allowed)
        self.schemas = tool_schemas(cfg, self.allowed)
        self.turns: list[AgentTurn] = []
        self.steps = self.tokens = self.submissions = 0
        self.files_written: list[str] = []
        self._t0: float | None = None

    def conditions(self) -> dict:
        """The evaluation conditions a trajectory records (SPEC §7.5)."""
        return {"model": self.provider.describe(), "harness": self.cfg.as_dict(), "tools": self.schemas,
                "prompt": {"system": self.system, "user": self.goal},
                "budget": dataclasses.asdict(self.budget), "effort": self.effort, "temperature": self.temperature,
                "max_tokens": self.max_tokens, "context_tokens": self.context_tokens, "seed": self.seed}

    def messages(self) -> list[dict]:
        extra = [{"role": "user", "content": self._memory()}] if self.cfg.memory else []

        def build(turns):
            return history_messages(self.system, self.goal, turns, self.provider.id, self.cfg.to_model, extra)

        view = compact(self.turns, self.cfg.context_strategy,
                       lambda v: estimate_tokens(build(v)) <= self.context_tokens)
        return build(view)

    def _memory(self) -> str:
        files = ", ".join(sorted(set(self.files_written))) or "none"
        return (f"Notes kept by the harness: files you wrote or edited: {files}; submissions used "
                f"{self.submissions}/{self.budget.submissions}; tool calls used {self.steps}/{self.budget.steps}.")

    def switch_provider(self, provider) -> None:
        """Continue the episode with another provider: it gets the earlier turns as a re-plan note,
        never their reasoning (``history_messages``); budgets and the wall clock carry on."""
        self.record("switch", {"from": self.provider.id, "to": provider.id, "model": provider.describe()})
        self.provider = provider

    def run(self) -> EpisodeResult:
        """Run until the provider stops or a budget ends; may be called again after a switch."""
        if self._t0 is None:
            self._t0 = self.clock()
        t0 = self._t0
        left = lambda: self.budget.wall_seconds - (self.clock() - t0)  # noqa: E731
        status, detail = "completed", ""
        while status == "completed":
            if left() <= 0:
                status = "wall_time_exceeded"
            elif self.steps >= self.budget.steps:
                status = "step_budget"
            elif self.tokens >= self.budget.tokens:
                status = "token_budget"
            if status != "completed":
                break
            req = ProviderRequest(self.messages(), self.schemas, self.cfg, self.max_tokens, self.temperature,
                                  self.seed, self.effort, timeout=max(left(), 0.1))
            t1 = self.clock()
            try:
                reply = self.provider.complete(req)
            except ProviderError as e:
                status, detail = "provider_error", str(e)
                break
            if reply is None:
                break
            self.tokens += reply.usage.get("prompt_tokens", 0) + reply.usage.get("completion_tokens", 0)
            meta = {"usage": reply.usage, "finish_reason": reply.finish_reason,
                    "elapsed": round(self.clock() - t1, 6), "sent_tokens": estimate_tokens(req.messages)}
            if reply.sample is not None:  # the sampled ids and their logprobs (RL's importance ratios)
                meta["sample"] = reply.sample
            turn = AgentTurn(reply.visible, reply.reasoning, [], [], self.provider.id, meta)
            self.turns.append(turn)
            index = len(self.turns) - 1
            self.record("turn", {"index": index, "provider": turn.provider, "visible": turn.visible,
                                 "reasoning": turn.reasoning, "tool_calls": reply.tool_calls,
                                 "metadata": turn.metadata})
            for raw in reply.tool_calls:
                if self.steps >= self.budget.steps:
                    status = "step_budget"
                    break
                self._call(index, turn, raw, left)
                if left() <= 0:
                    status = "wall_time_exceeded"
                    break
            if not reply.tool_calls and status == "completed":
                break
        return EpisodeResult(status, self.turns, self.steps, self.tokens, round(self.clock() - t0, 6),
                             self.submissions, detail)

    def _call(self, index: int, turn: AgentTurn, raw: dict, left) -> None:
        args = raw["arguments"]
        if isinstance(args, dict):
            name, cargs = self.cfg.from_model(raw["name"], args)
        else:  # arguments that were not a JSON object: answered with an error below
            name, cargs = self.cfg.from_model(raw["name"], {})[0], {"_raw": args}
        call = ToolCall(raw["id"], name or raw["name"], cargs)
        turn.tool_calls.append(call)
        self.steps += 1
        t1 = self.clock()
        if name is None or not isinstance(args, dict):
            why = f"unknown tool {raw['name']!r}" if name is None else "arguments are not a JSON object"
            result = ToolResult(call.id, call.name, f"error: {why}", error=True, meta={"bad_call": True})
        else:
            ctx = PolicyContext(self.tools.workdir, self.tools.env.get("HOME", "/root"),
                                allowed_tools=self.allowed, steps_left=self.budget.steps - self.steps + 1,
                                submissions_left=self.budget.submissions - self.submissions,
                                wall_left=left())
            d = self.policy.decide(name, cargs, call.id, ctx)
            self.record("policy", {"turn": index, **d.as_dict()})
            if not d.allowed:
                result = ToolResult(call.id, name, f"denied by policy ({d.rule}): {d.reason}", error=True,
                                    meta={"denied_by": d.rule})
                if name == "submit":
                    self.record("submission", {"turn": index, "call_id": call.id, "accepted": False,
                                               "reason": d.reason, "source": "submit"})
            elif name == "submit":
                self.submissions += 1
                text = self.submit_fn()
                result = ToolResult(call.id, name, text, meta={"submission": self.submissions})
            else:
                result = self.tools.run(name, cargs, timeout_cap=max(left(), 0.01))
                result.call_id = call.id
                if name in ("write", "edit") and not result.error:
                    self.files_written.append(cargs["path"])
        turn.tool_results.append(result)
        self.record("tool", {"turn": index, "call_id": call.id, "name": call.name, "arguments": call.arguments,
                             "result": result.as_dict(), "elapsed": round(self.clock() - t1, 6)})
