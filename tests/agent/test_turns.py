"""Reasoning is routed to its own provider only; compaction drops old tool outputs first, then cuts
old long arguments, and drops reasoning only with its whole turn, last."""

import json

from k3.agent.harness import ARG_KEEP, compact, estimate_tokens
from k3.agent.randomize import HarnessConfig
from k3.agent.turns import ELIDED_NOTE, REPLAN_NOTE, AgentTurn, ToolCall, ToolResult, elided_turn, history_messages


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


def test_nothing_recent_is_touched_even_when_nothing_fits():
    turns = [turn(i, "A") for i in range(4)]
    view = compact(turns, "drop_old_tool_outputs", lambda v: False, keep_recent=2)
    assert view[1:] == turns[2:]  # the last two turns whole: outputs and reasoning
    assert view[0].metadata["elided"] == {"turns": 2, "calls": {"shell": 2}}
    cfg = HarnessConfig.from_seed(11)
    note = history_messages("s", "g", view, "A", cfg.to_model)[2]
    assert note["role"] == "user" and note["content"] == ELIDED_NOTE.format(
        turns=2, calls=f"{cfg.tool_names['shell']} x2")
    assert "secret plan 0" not in json.dumps(history_messages("s", "g", view, "A"))


def long_turn(i):
    """A turn whose reasoning, output and write argument are each long."""
    return AgentTurn(f"step {i}", f"plan {i} " + "r" * 600,
                     [ToolCall(f"c{i}", "write", {"path": f"f{i}.txt", "content": f"{i}" + "w" * 2000})],
                     [ToolResult(f"c{i}", "write", "o" * 1500)], "A")


def test_stages_in_order_and_reasoning_leaves_only_with_its_turn():
    turns = [long_turn(i) for i in range(8)]
    tokens = lambda v: estimate_tokens(sent(v))  # noqa: E731
    full = tokens(turns)
    # stage 2 is enough: outputs dropped oldest first, no argument cut, every turn and its reasoning kept
    v2 = compact(turns, "drop_old_tool_outputs", lambda v: tokens(v) <= full - 500)
    assert [t.tool_results[0].dropped for t in v2] == [True, True] + [False] * 6
    assert [t.tool_calls for t in v2] == [t.tool_calls for t in turns]
    # all old outputs gone but not enough: the oldest write contents cut to head and tail
    no_outputs = full - 6 * (1500 - 60) // 4
    v3 = compact(turns, "drop_old_tool_outputs", lambda v: tokens(v) <= no_outputs - 500)
    assert all(t.tool_results[0].dropped for t in v3[:6]) and not v3[6].tool_results[0].dropped
    cut = [len(t.tool_calls[0].arguments["content"]) < 2001 for t in v3]
    assert cut[0] and not cut[-1] and cut == sorted(cut, reverse=True)
    head = v3[0].tool_calls[0].arguments["content"]
    assert head.startswith("0" + "w" * (ARG_KEEP - 1)) and "chars cut to save context" in head
    assert [t.reasoning for t in v3] == [t.reasoning for t in turns] and len(v3) == 8
    # below what even that gives: the oldest turns go whole, as few as fit
    all_cut = lambda v: all("chars cut" in t.tool_calls[0].arguments.get("content", "") for t in v[:6])  # noqa: E731
    stage3 = compact(turns, "drop_old_tool_outputs", all_cut)
    assert all(t.tool_results[0].dropped for t in stage3[:6]) and len(stage3) == 8
    limit = tokens(stage3) - 300
    v4 = compact(turns, "drop_old_tool_outputs", lambda v: tokens(v) <= limit)
    k = v4[0].metadata["elided"]["turns"]
    assert 1 <= k < 6 and tokens(v4) <= limit and v4[1:] == stage3[k:]
    assert [t.reasoning for t in v4[1:]] == [t.reasoning for t in turns[k:]]
    assert tokens(([elided_turn(turns[:k - 1])] if k > 1 else []) + stage3[k - 1:]) > limit  # one turn fewer would not fit
    assert all(len(t.tool_results[0].output) == 1500 for t in turns)  # the originals are untouched


def test_a_long_episode_stays_under_its_limit_for_every_strategy():
    for strategy in ("drop_old_tool_outputs", "truncate_tool_outputs", "sliding_window"):
        turns = [long_turn(i) for i in range(60)]
        for n in range(1, 61):
            view = compact(turns[:n], strategy, lambda v: estimate_tokens(sent(v)) <= 3000)
            assert estimate_tokens(sent(view)) <= 3000, (strategy, n)
            assert view[-2:] == turns[max(0, n - 2):n]
        assert estimate_tokens(sent(turns)) > 10 * 3000  # the control: uncompacted, far over


def test_truncate_first_then_drop_and_sliding_window():
    turns = [turn(i, "A") for i in range(5)]
    full = estimate_tokens(sent(turns))
    view = compact(turns, "truncate_tool_outputs", lambda v: estimate_tokens(sent(v)) <= full - 200)
    outs = [t.tool_results[0].output for t in view]
    assert all("[... cut ...]" in o for o in outs[:3]) and outs[3:] == [t.tool_results[0].output for t in turns[3:]]
    view = compact(turns, "sliding_window", lambda v: estimate_tokens(sent(v)) <= full - 10)
    assert [t.tool_results[0].output.startswith("[output dropped") for t in view] == [True] * 3 + [False] * 2
    assert compact(turns, "sliding_window", lambda v: True)[0].tool_results[0].output == turns[0].tool_results[0].output
