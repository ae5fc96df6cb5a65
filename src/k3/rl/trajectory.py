"""Trajectories as JSONL (SPEC §7.5) and their replay.

One JSON object per line, each with ``"type"`` and ``"t"`` (seconds since the rollout began):

- ``header``: version, task (id, path, sha256 of its files), backend, the full evaluation conditions
  (model, harness config incl. randomization, tool schemas as sent, prompt, budget, effort,
  temperature, max_tokens, context_tokens, seed), policy options (yolo, network);
- ``turn``: index, provider id, visible text, reasoning, the tool calls as the model sent them
  (model-side names), metadata (usage, finish_reason, elapsed, sent_tokens; ``over_context`` when even
  the compacted context did not fit; ``memory``, the note as sent, when harness memory was on);
- ``policy``: one decision of the chain per tool call (action, allowed, rule, reason, effects);
- ``tool``: call id, canonical name and arguments, the result (output, error, meta), elapsed;
- ``submission``: accepted or refused (with the reason), the manifest (sha256 + size per file);
- ``verdict``: per verified submission: reward, reason, timings;
- ``end``: status, score, steps, tokens, timings.

``k3.rl.rollout.replay(path)`` runs the task again with a provider that repeats the recorded turns under the
recorded conditions (harness config, budget, policy options and recorded approvals), then
compares tool results, policy decisions, submissions, verdicts and the final score with the
recording (timing fields excluded). ``ReplayReport.ok`` is True when all of them match.

``to_chat(trajectory, meta)`` turns an episode into one SFT row (docs/AGENTS.md, "SFT rows"):
``{"messages", "tools", "reasoning_effort"?, "meta"}``, exactly the conversation the model was
sent: the recorded system prompt and goal, the tool schemas and effort as sent, then each
assistant turn (``reasoning_content``, ``content``, ``tool_calls`` when it made calls, under the
harness's model-side names) and its tool results. Rendered up to assistant turn k with the
generation prompt, it gives the ids a ``LocalEngine`` rendered for request k. Refused when no
single conversation is what the model saw: a provider switch (re-plan notes), harness memory (a
note re-sent at the end of every request) or a compacted context.

``to_turn_chats(trajectory, meta, every)`` gives one row per (every-th) turn instead: what that turn
was sent (compacted, with its memory note), then the turn, the only one with loss; it takes the
episodes ``to_chat`` refuses for compaction or memory.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

from k3.agent.harness import estimate_tokens, sent_messages
from k3.agent.providers import ProviderReply, ProviderRequest
from k3.agent.randomize import HarnessConfig
from k3.agent.turns import AgentTurn, ToolCall, ToolResult, history_messages
from k3.errors import K3Error

__all__ = ["TrajectoryWriter", "read_trajectory", "ReplayProvider", "ReplayReport", "compare", "to_chat",
           "to_turn_chats", "VERSION"]

VERSION = 1


class TrajectoryWriter:
    """Appends records; to ``path`` (one line each, flushed) when given, and always to ``records``."""

    def __init__(self, path: str | Path | None = None):
        self.path = Path(path) if path is not None else None
        self.records: list[dict] = []
        self.t0 = time.monotonic()
        self._f = None
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._f = open(self.path, "w", encoding="utf-8")

    def write(self, kind: str, data: dict) -> None:
        rec = {"type": kind, "t": round(time.monotonic() - self.t0, 6), **data}
        self.records.append(rec)
        if self._f is not None:
            self._f.write(json.dumps(rec, ensure_ascii=False) + "\n")
            self._f.flush()

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None


def read_trajectory(path: str | Path) -> list[dict]:
    path = Path(path)
    out = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except ValueError:
            raise K3Error(f"{path}:{n}: not a JSON line") from None
        if not isinstance(rec, dict) or "type" not in rec:
            raise K3Error(f"{path}:{n}: a trajectory record needs a 'type'")
        out.append(rec)
    if not out or out[0]["type"] != "header":
        raise K3Error(f"{path}: a trajectory starts with a header record")
    if out[0].get("version") != VERSION:
        raise K3Error(f"{path}: trajectory version {out[0].get('version')!r}, this k3 reads {VERSION}")
    return out


class ReplayProvider:
    """Repeats recorded ``turn`` records (model-side tool calls, reasoning, usage) in order."""

    def __init__(self, header: dict, turns: list[dict]):
        model = header["conditions"]["model"]
        self.id = model.get("id", "replay")
        self.model = model.get("model", "replay")
        self._desc = dict(model)
        self.turns, self.next = turns, 0

    def describe(self) -> dict:
        return self._desc

    def complete(self, req: ProviderRequest) -> ProviderReply | None:
        if self.next >= len(self.turns):
            return None
        t = self.turns[self.next]
        self.next += 1
        md = t.get("metadata", {})
        return ProviderReply(t["visible"], t.get("reasoning"), [dict(c) for c in t["tool_calls"]],
                             dict(md.get("usage") or {"prompt_tokens": 0, "completion_tokens": 0}),
                             md.get("finish_reason"))

    def close(self) -> None:
        pass


def _key(rec: dict):
    """What must reproduce in a record (timings and clamped timeouts left out)."""
    kind = rec["type"]
    if kind == "tool":
        r = rec["result"]
        meta = {k: r["meta"][k] for k in ("exit_code", "timed_out") if k in r["meta"]}
        return ("tool", rec["call_id"], rec["name"], json.dumps(rec["arguments"], sort_keys=True),
                r["output"], r["error"], json.dumps(meta, sort_keys=True))
    if kind == "policy":
        return ("policy", rec["call_id"], rec["action"], rec["allowed"], rec["rule"], rec["reason"])
    if kind == "submission":
        return ("submission", rec.get("accepted"), json.dumps(rec.get("manifest"), sort_keys=True),
                rec.get("reason"))
    if kind == "verdict":
        return ("verdict", rec["submission"], rec["reward"], rec["reason"])
    if kind == "end":
        return ("end", rec["status"], rec["score"])
    return None


@dataclass
class ReplayReport:
    compared: dict = field(default_factory=dict)      # kind -> records compared
    mismatches: list[str] = field(default_factory=list)
    score: float | None = None
    recorded_score: float | None = None

    @property
    def ok(self) -> bool:
        return not self.mismatches


def compare(recorded: list[dict], replayed: list[dict]) -> ReplayReport:
    rep = ReplayReport()
    for kind in ("tool", "policy", "submission", "verdict", "end"):
        a = [_key(r) for r in recorded if r["type"] == kind]
        b = [_key(r) for r in replayed if r["type"] == kind]
        rep.compared[kind] = len(a)
        if len(a) != len(b):
            rep.mismatches.append(f"{kind}: {len(a)} recorded, {len(b)} replayed")
        for i, (x, y) in enumerate(zip(a, b)):
            if x != y:
                rep.mismatches.append(f"{kind}[{i}]: recorded {str(x)[:300]} != replayed {str(y)[:300]}")
    ends = [r for r in recorded if r["type"] == "end"], [r for r in replayed if r["type"] == "end"]
    rep.recorded_score = ends[0][0]["score"] if ends[0] else None
    rep.score = ends[1][0]["score"] if ends[1] else None
    return rep


def _records(trajectory) -> list[dict]:
    if isinstance(trajectory, (str, Path)):
        return read_trajectory(trajectory)
    recs = list(trajectory)
    if not recs or not isinstance(recs[0], dict) or recs[0].get("type") != "header":
        raise K3Error("a trajectory starts with a header record")
    if recs[0].get("version") != VERSION:
        raise K3Error(f"trajectory version {recs[0].get('version')!r}, this k3 reads {VERSION}")
    return recs


def _conditions(head: dict) -> dict:
    """The header's conditions, with every field ``to_chat`` reads present (else a K3Error naming it)."""
    need = {"conditions": dict, "task": dict}
    for k, t in need.items():
        if not isinstance(head.get(k), t):
            raise K3Error(f"trajectory header: {k!r} is missing (a header written by k3 task run has it)")
    cond = head["conditions"]
    for k in ("model", "harness", "tools", "prompt", "context_tokens"):
        if k not in cond:
            raise K3Error(f"trajectory header: conditions.{k} is missing")
    if not isinstance(cond["prompt"], dict) or not {"system", "user"} <= set(cond["prompt"]):
        raise K3Error("trajectory header: conditions.prompt must hold the system and user prompts as sent")
    if "id" not in head["task"]:
        raise K3Error("trajectory header: task.id is missing")
    return cond


def episode_turns(recs: list[dict]) -> list[AgentTurn]:
    """The harness's turns rebuilt from ``turn`` and ``tool`` records (calls as the harness ran
    them: canonical names and arguments, each with its result)."""
    turns = [AgentTurn(r["visible"], r.get("reasoning"), [], [], r["provider"], r.get("metadata", {}))
             for r in recs if r["type"] == "turn"]
    for r in recs:
        if r["type"] == "tool":
            t = turns[r["turn"]]
            t.tool_calls.append(ToolCall(r["call_id"], r["name"], r["arguments"]))
            t.tool_results.append(ToolResult(**r["result"]))
    return turns


def _one_model(recs: list[dict], what: str):
    """(conditions, harness config, turns, provider id) of an episode one model played throughout,
    or a K3Error naming why not (a provider switch, several providers)."""
    cond = _conditions(recs[0])
    if any(r["type"] == "switch" for r in recs):
        raise K3Error(f"{what}: the episode switched providers; the later model saw re-plan notes, "
                      "not one conversation")
    cfg = HarnessConfig.from_dict(cond["harness"])
    turns = episode_turns(recs)
    providers = {t.provider for t in turns}
    if len(providers) > 1:
        raise K3Error(f"{what}: turns of several providers {sorted(providers)}")
    pid = providers.pop() if providers else cond["model"].get("id", "")
    return cond, cfg, turns, pid


def _row(recs: list[dict], cond: dict, messages: list[dict], meta: dict | None) -> dict:
    for m in messages:
        if m["role"] == "assistant":
            m.setdefault("reasoning_content", "")
    ends = [r for r in recs if r["type"] == "end"]
    row = {"messages": messages, "tools": list(cond["tools"])}
    if cond.get("effort") is not None:
        row["reasoning_effort"] = cond["effort"]
    row["meta"] = {"task": recs[0]["task"]["id"], "reward": ends[-1]["score"] if ends else None,
                   "effort": cond.get("effort"), **(meta or {})}
    return row


def to_chat(trajectory, meta: dict | None = None) -> dict:
    """One SFT row from a trajectory (a JSONL path or its parsed records); see the module doc.
    ``meta`` is merged over the row's own ``{"task", "reward", "effort"}``."""
    recs = _records(trajectory)
    cond, cfg, turns, pid = _one_model(recs, "to_chat")
    if cfg.memory:
        raise K3Error("to_chat: harness memory was on (a note re-sent at the end of every request); "
                      "synthesize with the canonical harness, or one row per turn (to_turn_chats)")
    system, user = cond["prompt"]["system"], cond["prompt"]["user"]
    for k in range(len(turns)):
        sent = history_messages(system, user, turns[:k], pid, cfg.to_model)
        if estimate_tokens(sent) > cond["context_tokens"]:
            raise K3Error(f"to_chat: the harness compacted the context before turn {k} (over "
                          f"{cond['context_tokens']} estimated tokens); the model saw shortened tool outputs")
    return _row(recs, cond, history_messages(system, user, turns, pid, cfg.to_model), meta)


def to_turn_chats(trajectory, meta: dict | None = None, every: int = 1) -> list[dict]:
    """SFT rows of one episode, one per assistant turn k with ``k % every == every - 1`` (and the
    last turn): the messages the harness sent for turn k, compacted as it compacted them
    (``k3.agent.harness.sent_messages`` under the recorded harness config and ``context_tokens``,
    with the memory note the turn records when memory was on), then turn k's assistant message.
    Earlier assistant messages carry ``weight`` 0, so each row trains only the turn the model
    produced from exactly that context. ``meta`` as ``to_chat``'s, plus ``turn``."""
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise K3Error(f"to_turn_chats: every must be an int >= 1, got {every!r}")
    recs = _records(trajectory)
    cond, cfg, turns, pid = _one_model(recs, "to_turn_chats")
    system, user = cond["prompt"]["system"], cond["prompt"]["user"]
    rows = []
    for k, t in enumerate(turns):
        if k % every != every - 1 and k != len(turns) - 1:
            continue
        extra = None
        if cfg.memory:
            if not isinstance(t.metadata.get("memory"), str):
                raise K3Error(f"to_turn_chats: harness memory was on but turn {k} records no memory note "
                              "(metadata.memory; a trajectory from before notes were recorded)")
            extra = [{"role": "user", "content": t.metadata["memory"]}]
        sent = sent_messages(system, user, turns[:k], pid, cfg, cond["context_tokens"], extra)
        recorded = t.metadata.get("sent_tokens")
        if recorded is not None and estimate_tokens(sent) != recorded:
            raise K3Error(f"to_turn_chats: turn {k}'s context rebuilds to {estimate_tokens(sent)} estimated "
                          f"tokens, but the harness recorded {recorded}: not what the model was sent")
        msgs = [{**m, "weight": 0} if m["role"] == "assistant" else m for m in sent]
        last = history_messages(system, user, [t], pid, cfg.to_model)[2]
        rows.append(_row(recs, cond, msgs + [last], {**(meta or {}), "turn": k}))
    return rows
