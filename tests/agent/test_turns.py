"""Reasoning is routed to its own provider only; compaction drops old tool outputs first and never
reasoning."""

import json

from k3.agent.harness import compact, estimate_tokens
from k3.agent.randomize import HarnessConfig
from k3.agent.turns import REPLAN_NOTE, AgentTurn, ToolCall, ToolResult, history_messages


def turn(i, provider, out="x" * 1000):
    return AgentTurn(f"step {i}", f"secret plan {i} of {provider}",
                     [ToolCall(f"c{i}", "shell", {"command": f"echo {i}"})],
                     [ToolResult(f"c{i}", "shell", f"exit code 0\n{out}")], provider)


def test_reasoning_goes_back_only_to_the_provider_that_made_it():
    turns = [turn(0, "A"), turn(1, "A"), turn(2, "B")]
    to_a = history_messages("sys", "goal", turns, "A")
    sent_a = json.dumps(to_a)
    assert "secret plan 0 of A" in sent_a and "secret plan 1 of A" in sent_a
    assert "secret plan 2 of B" not in sent_a
    assert [m["reasoning_content"] for m in to_a if m["role"] == "assistant"] == \
        ["secret plan 0 of A", "secret plan 1 of A"]
    to_b = history_messages("sys", "goal", turns, "B")
    assert "secret plan 0 of A" not in json.dumps(to_b) and "secret plan 1 of A" not in json.dumps(to_b)
    replan = [m for m in to_b if m["role"] == "user" and m["content"].startswith(REPLAN_NOTE)]
    assert len(replan) == 1 and "echo 0" in replan[0]["content"] and "echo 1" in replan[0]["content"]
    assert to_b[-2]["reasoning_content"] == "secret plan 2 of B"  # its own reasoning still goes back


def test_history_uses_the_renamed_tools():
    cfg = HarnessConfig.from_seed(11)
    msgs = history_messages("s", "g", [turn(0, "A")], "A", cfg.to_model)
    fn = msgs[2]["tool_calls"][0]["function"]
    assert fn["name"] == cfg.tool_names["shell"]
    assert json.loads(fn["arguments"]) == {cfg.arg_names["command"]: "echo 0"}


def test_show_hides_reasoning_by_default():
    t = turn(0, "A")
    assert "secret plan" not in t.show() and "secret plan 0 of A" in t.show(reasoning=True)


def sent(view):
    return history_messages("s", "g", view, "A")


def test_drop_old_tool_outputs_drops_oldest_first_and_keeps_all_reasoning():
    turns = [turn(i, "A") for i in range(6)]
    full = estimate_tokens(sent(turns))
    limit = full - 200  # one dropped output (~245 tokens) makes it fit
    view = compact(turns, "drop_old_tool_outputs", lambda v: estimate_tokens(sent(v)) <= limit)
    dropped = [i for i, t in enumerate(view) if t.tool_results[0].output.startswith("[output dropped")]
    assert dropped == [0]
    assert estimate_tokens(sent(view)) <= limit
    assert [t.reasoning for t in view] == [t.reasoning for t in turns]
    assert all(t.tool_results[0].output.endswith("x" * 1000) for t in turns)  # the originals are untouched


def test_nothing_recent_is_dropped_even_when_it_does_not_fit():
    turns = [turn(i, "A") for i in range(4)]
    view = compact(turns, "drop_old_tool_outputs", lambda v: False, keep_recent=2)
    kept = [not t.tool_results[0].output.startswith("[output dropped") for t in view]
    assert kept == [False, False, True, True]
    assert all(t.reasoning for t in view)


def test_truncate_first_then_drop_and_sliding_window():
    turns = [turn(i, "A") for i in range(5)]
    full = estimate_tokens(sent(turns))
    view = compact(turns, "truncate_tool_outputs", lambda v: estimate_tokens(sent(v)) <= full - 200)
    outs = [t.tool_results[0].output for t in view]
    assert all("[... cut ...]" in o for o in outs[:3]) and outs[3:] == [t.tool_results[0].output for t in turns[3:]]
    view = compact(turns, "sliding_window", lambda v: estimate_tokens(sent(v)) <= full - 10)
    assert [t.tool_results[0].output.startswith("[output dropped") for t in view] == [True] * 3 + [False] * 2
    assert compact(turns, "sliding_window", lambda v: True)[0].tool_results[0].output == turns[0].tool_results[0].output
