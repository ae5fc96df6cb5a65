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
data URL's characters. Over ``context_tokens``, the view is shortened in stages, each only as far
as it must go (the fewest oldest edits that fit) and the next one only if it still does not fit:

1. the strategy's own step: nothing (``drop_old_tool_outputs``), every old output over 400
   characters cut to a head and tail of 200 each (``truncate_tool_outputs``), or every old output
   dropped at once (``sliding_window``);
2. old tool outputs dropped, oldest first (a dropped output's images go with it);
3. old calls' string arguments over ``2 * ARG_KEEP`` characters cut to head and tail, oldest first;
4. the oldest turns dropped whole, replaced by one note that counts them and their tool calls
   (``k3.agent.turns.elided_turn``).

"Old" is every turn but the last ``keep_recent``, which are never touched. Reasoning is kept
through stages 1-3 and leaves only with its whole turn, after every old output and long argument
is gone: a fixed context cannot hold an unbounded history, and this order keeps the model's own
thinking longest. When even the goal and the last turns do not fit, the turn record's metadata
says so (``over_context``). Only what is sent is compacted; the trajectory keeps every turn
whole, and each turn record's ``metadata.sent_tokens`` is the estimate of what was sent for it
(RL trains on the recorded ``prompt_ids`` of what was sent, so its importance ratios hold).
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
from k3.agent.turns import AgentTurn, ToolCall, ToolResult, elided_turn, history_messages
from k3.tasks.format import Budget

__all__ = ["EpisodeResult", "Harness", "compact", "sent_messages", "estimate_tokens", "IMAGE_TOKENS", "ARG_KEEP"]


@dataclass
class EpisodeResult:
    status: str                # completed | wall_time_exceeded | step_budget | token_budget | provider_error
    turns: list[AgentTurn]
    steps: int
    tokens: int
    elapsed: float
    submissions: int
    detail: str = ""


ARG_KEEP = 200  # head and tail characters kept of an old call's long string argument
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


def _is_stub(r: ToolResult) -> bool:
    return r.dropped and r.output.startswith("[output dropped")


def _dropped(r: ToolResult) -> ToolResult:
    if _is_stub(r):
        return r
    stub = f"[output dropped to save context: {len(r.output)} chars" + \
        (f", {len(r.images)} image(s)]" if r.images else "]")
    return _with_output(r, stub, keep_images=False)


def _cut_arguments(c: ToolCall) -> ToolCall:
    """``c`` with every string argument longer than ``2 * ARG_KEEP`` cut to its head and tail."""
    def cut(v):
        if isinstance(v, str) and len(v) > 2 * ARG_KEEP:
            return f"{v[:ARG_KEEP]}\n[... {len(v) - 2 * ARG_KEEP} chars cut to save context ...]\n{v[-ARG_KEEP:]}"
        return v
    return dataclasses.replace(c, arguments={k: cut(v) for k, v in c.arguments.items()})


def _copy(turns: list[AgentTurn]) -> list[AgentTurn]:
    """Turns whose call and result lists may be edited without touching ``turns``."""
    return [dataclasses.replace(t, tool_calls=list(t.tool_calls), tool_results=list(t.tool_results)) for t in turns]


def _fewest(n: int, view_of: Callable[[int], list[AgentTurn]], fits) -> tuple[list[AgentTurn], bool]:
    """The view of the fewest ``k`` in 1..n edits (oldest first) that fits, by bisection over ``k``
    (each edit only shortens what is sent); else the view with all ``n``, and False."""
    full = view_of(n)
    if n == 0 or not fits(full):
        return full, False
    lo, hi = 1, n
    while lo < hi:
        mid = (lo + hi) // 2
        if fits(view_of(mid)):
            hi = mid
        else:
            lo = mid + 1
    return view_of(lo), True


def compact(turns: list[AgentTurn], strategy: str, fits: Callable[[list[AgentTurn]], bool],
            keep_recent: int = 2) -> list[AgentTurn]:
    """Copies of ``turns`` shortened in stages until ``fits(view)`` (see module doc): the strategy's
    outputs, old outputs dropped, old long arguments cut, then the oldest turns dropped whole."""
    view = _copy(turns)
    if fits(view):
        return view
    old = range(max(0, len(view) - keep_recent))

    if strategy in ("sliding_window", "truncate_tool_outputs"):
        for i in old:
            for j, r in enumerate(view[i].tool_results):
                if strategy == "sliding_window":
                    view[i].tool_results[j] = _dropped(r)
                elif len(r.output) > 400:
                    view[i].tool_results[j] = _with_output(r, f"{r.output[:200]}\n[... cut ...]\n{r.output[-200:]}")
        if fits(view):
            return view

    def edited(base, units, edit):
        def view_of(k):
            v = _copy(base)
            for i, j in units[:k]:
                edit(v[i], j)
            return v
        return view_of

    def drop(t, j):
        t.tool_results[j] = _dropped(t.tool_results[j])

    def cut(t, j):
        t.tool_calls[j] = _cut_arguments(t.tool_calls[j])

    outputs = [(i, j) for i in old for j, r in enumerate(view[i].tool_results) if not _is_stub(r)]
    view, ok = _fewest(len(outputs), edited(view, outputs, drop), fits)
    if ok:
        return view
    long_calls = [(i, j) for i in old for j, c in enumerate(view[i].tool_calls) if _cut_arguments(c) != c]
    view, ok = _fewest(len(long_calls), edited(view, long_calls, cut), fits)
    if ok:
        return view
    base = view
    view, _ = _fewest(len(old), lambda k: ([elided_turn(base[:k])] if k else []) + base[k:], fits)
    return view


def sent_messages(system: str, goal: str, turns: list[AgentTurn], provider_id: str, cfg: HarnessConfig,
                  context_tokens: int, extra: list[dict] | None = None) -> list[dict]:
    """The messages the harness sends ``provider_id`` after ``turns``: the history compacted by
    ``cfg``'s strategy to ``context_tokens`` (``extra``: the memory note, sent last)."""
    def build(view):
        return history_messages(system, goal, view, provider_id, cfg.to_model, extra)

    return build(compact(turns, cfg.context_strategy, lambda v: estimate_tokens(build(v)) <= context_tokens))


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

    def messages(self, memory: str | None = None) -> list[dict]:
        """What the provider is sent next; ``memory``: the harness's note (sent last when memory is on)."""
        extra = [{"role": "user", "content": memory}] if memory is not None else []
        return sent_messages(self.system, self.goal, self.turns, self.provider.id, self.cfg, self.context_tokens,
                             extra)

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
            memory = self._memory() if self.cfg.memory else None
            req = ProviderRequest(self.messages(memory), self.schemas, self.cfg, self.max_tokens, self.temperature,
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
            if meta["sent_tokens"] > self.context_tokens:  # even the last turns and the goal do not fit
                meta["over_context"] = True
            if memory is not None:  # the note as sent (it changes every turn): per-turn SFT rows rebuild it
                meta["memory"] = memory
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
