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
