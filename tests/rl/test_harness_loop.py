"""The harness loop in a real sandbox: what the provider is sent under compaction and memory, and
the token budget. ``Recording`` is a Scripted provider that also keeps each request it got."""

from k3.agent.harness import estimate_tokens
from k3.agent.providers import Scripted
from k3.agent.randomize import HarnessConfig
from k3.rl.rollout import run_episode
from k3.rl.trajectory import ReplayProvider, TrajectoryWriter
from taskdirs import FIXED, make_task


class Recording(Scripted):
    def __init__(self, turns):
        super().__init__(turns)
        self.requests = []

    def complete(self, req):
        self.requests.append(req)
        return super().complete(req)


def test_compaction_drops_the_oldest_outputs_keeps_reasoning_and_memory_reports_state(tmp_path, sandboxes):
    d = make_task(tmp_path)
    turns = [{"reasoning": f"plan {i}", "content": f"step {i}",
              "tool_calls": [{"name": "shell", "arguments": {"command": f"seq {i} 600"}}]} for i in range(5)]
    turns.append({"reasoning": "plan 5", "tool_calls": [{"name": "write", "arguments": {"path": "calc.py",
                                                                                        "content": FIXED}},
                                                        {"name": "submit", "arguments": {}}]})
    turns.append({"reasoning": "done", "content": "finished"})
    p = Recording(turns)
    w = TrajectoryWriter()
    cfg = HarnessConfig(memory=True, context_strategy="drop_old_tool_outputs")
    s = run_episode(d, p, w, sandboxes=sandboxes, harness=cfg.as_dict(), context_tokens=2000)
    assert s["score"] == 1.0
    last = p.requests[-1].messages
    assert estimate_tokens(last) <= 2000
    tools = [m["content"] for m in last if m["role"] == "tool"]
    dropped = [t.startswith("[output dropped to save context") for t in tools]
    assert dropped[0] and not any(dropped[-2:]) and dropped == sorted(dropped, reverse=True)  # oldest first
    assert [m.get("reasoning_content") for m in last if m["role"] == "assistant"] == [f"plan {i}" for i in range(6)]
    assert last[-1]["role"] == "user" and "calc.py" in last[-1]["content"] and "submissions used 1/2" in last[-1]["content"]
    first = p.requests[0].messages
    assert "submissions used 0/2" in first[-1]["content"]  # memory is there from the start
    full = [r["result"]["output"] for r in w.records if r["type"] == "tool" and r["name"] == "shell"]
    assert all(o.rstrip().endswith("600") for o in full)  # the trajectory keeps every output whole
    # memory off: no harness note (one turn, nothing submitted, so nothing to verify)
    p2 = Recording(turns[-1:])
    run_episode(make_task(tmp_path / "b"), p2, TrajectoryWriter(), sandboxes=sandboxes,
                harness=HarnessConfig(memory=False).as_dict())
    assert all("Notes kept by the harness" not in str(m.get("content")) for m in p2.requests[-1].messages)


def test_the_token_budget_stops_the_episode(tmp_path, sandboxes):
    d = make_task(tmp_path, tokens=2000)
    header = {"conditions": {"model": {"kind": "replay", "model": "m", "id": "m"}}}
    turn = {"visible": "", "reasoning": "r", "tool_calls": [{"id": "c", "name": "shell",
                                                              "arguments": {"command": "true"}}],
            "metadata": {"usage": {"prompt_tokens": 600, "completion_tokens": 500}}}
    w = TrajectoryWriter()
    s = run_episode(d, ReplayProvider(header, [turn] * 5), w, sandboxes=sandboxes)
    assert (s["status"], s["tokens"], s["steps"]) == ("token_budget", 2200, 2)
    ok = run_episode(make_task(tmp_path / "b", tokens=20000), ReplayProvider(header, [turn] * 5),
                     TrajectoryWriter(), sandboxes=sandboxes)
    assert (ok["status"], ok["tokens"], ok["steps"]) == ("completed", 5500, 5)


def test_a_provider_switch_replans_without_the_old_reasoning(tmp_path, sandboxes):
    from k3.agent.harness import Harness
    from k3.tasks.format import Budget
    from k3.agent.policy import Policy
    from k3.agent.tools import ToolBox
    from k3.agent.turns import REPLAN_NOTE

    a = Recording([{"reasoning": "A's private plan", "content": "looking",
                    "tool_calls": [{"name": "shell", "arguments": {"command": "echo from-a"}}]}])
    a.id = "provider-a"
    b = Recording([{"reasoning": "B's plan", "tool_calls": [{"name": "list", "arguments": {}}]},
                   {"reasoning": "B again", "content": "done"}])
    b.id = "provider-b"
    records = []
    with sandboxes.create() as sb:
        h = Harness(a, ToolBox(sb), Policy(), HarnessConfig(), Budget(), "goal", lambda: "ok",
                    lambda k, d: records.append((k, d)))
        h.run()
        h.switch_provider(b)
        res = h.run()
    assert [t.provider for t in res.turns] == ["provider-a", "provider-b", "provider-b"] and res.steps == 2
    first_b, last_b = b.requests[0].messages, b.requests[-1].messages
    assert "A's private plan" not in str(first_b) and "A's private plan" not in str(last_b)
    note = [m["content"] for m in first_b if m["role"] == "user" and m["content"].startswith(REPLAN_NOTE)]
    assert len(note) == 1 and "echo from-a" in note[0] and "from-a" in note[0]  # the call and its result
    assert [m.get("reasoning_content") for m in last_b if m["role"] == "assistant"] == ["B's plan"]
    assert ("switch", {"from": "provider-a", "to": "provider-b", "model": b.describe()}) in records
