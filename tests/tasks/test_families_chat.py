"""SFT rows from trajectories (k3.rl.trajectory.to_chat): the conversation the model was sent.

For every assistant turn k of a synthesized episode, the row rendered up to turn k with the
generation prompt is token for token the prompt ``LocalEngine`` renders for request k (the harness's
request, recorded as it was sent), and the training rendering of the whole row starts with it,
its loss mask starting at turn k's reasoning. Episodes with no single conversation are refused."""

import json

import pytest

from k3.agent.providers import Scripted, render_prompt
from k3.agent.randomize import HarnessConfig
from k3.tasks.tool_specs import TOOL_SPECS
from k3.data.chat import ChatFormat
from k3.data.tokenizer import train_tokenizer
from k3.errors import K3Error
from k3.rl.rollout import run_episode
from k3.agent.harness import estimate_tokens
from k3.agent.turns import ELIDED_NOTE
from k3.rl.trajectory import TrajectoryWriter, to_chat, to_turn_chats
from k3.tasks.families import EFFORTS, FAMILIES, get_family

ROW_KEYS = {"messages", "tools", "reasoning_effort", "meta"}
META_KEYS = {"family", "domain", "seed", "split", "task", "reward", "effort"}


class Recording(Scripted):
    """A Scripted provider that also keeps every request the harness sent it."""

    def __init__(self, turns):
        super().__init__(turns)
        self.requests = []

    def complete(self, req):
        self.requests.append(req)
        return super().complete(req)


@pytest.fixture(scope="module")
def fmt():
    texts = [json.dumps(FAMILIES[n].solve(FAMILIES[n].spec(s), e)) for n in FAMILIES for s in range(6)
             for e in EFFORTS]
    texts += [json.dumps(TOOL_SPECS), "exit code 0\nsubmission accepted wrote bytes to answer.txt"]
    return ChatFormat(train_tokenizer(texts * 3, vocab_size=700))


def synthesized(tmp_path, sandboxes, name, effort, seed=0, **kw):
    fam = get_family(name)
    d = fam.generate(seed, tmp_path)
    p = Recording(fam.solve(d, effort))
    out = tmp_path / f"{name}-{effort}.jsonl"
    w = TrajectoryWriter(out)
    s = run_episode(d, p, w, sandboxes=sandboxes, effort=effort, **kw)
    w.close()
    return s, w.records, p.requests, out


@pytest.mark.parametrize("name", sorted(FAMILIES))
@pytest.mark.parametrize("effort", EFFORTS)
def test_each_prompt_of_the_row_is_the_prompt_the_local_engine_renders(tmp_path, sandboxes, fmt, name, effort):
    s, recs, requests, out = synthesized(tmp_path, sandboxes, name, effort)
    assert s["score"] == 1.0
    fam = FAMILIES[name]
    row = to_chat(recs, {"family": name, "domain": fam.domain, "seed": 0, "split": "train"})
    assert to_chat(out, row["meta"]) == row  # from the file, the same row
    assert set(row) == ROW_KEYS and set(row["meta"]) == META_KEYS
    assert row["meta"] == {"family": name, "domain": fam.domain, "seed": 0, "split": "train",
                           "task": f"{name}-0", "reward": 1.0, "effort": effort}
    assert row["reasoning_effort"] == effort and json.loads(json.dumps(row)) == row
    msgs = row["messages"]
    starts = [i for i, m in enumerate(msgs) if m["role"] == "assistant"]
    assert len(starts) == len(requests) == len([r for r in recs if r["type"] == "turn"])
    ids, mask = fmt.render_for_training(msgs, tools=row["tools"], reasoning_effort=row["reasoning_effort"])
    for k, (i, req) in enumerate(zip(starts, requests)):
        engine_prompt = render_prompt(fmt, req)
        row_prompt = fmt.render(msgs[:i], tools=row["tools"], reasoning_effort=row["reasoning_effort"])
        assert row_prompt == engine_prompt, f"turn {k}"
        assert req.messages == msgs[:i]
        n = len(engine_prompt)
        assert ids[:n] == engine_prompt and mask[n - 1] == 0 and mask[n] == 1  # loss from turn k's reasoning
    assert sum(mask) > 0 and mask[-1] == 1 and ids[-1] == fmt.end_id
    for m in msgs:
        assert m["role"] in ("system", "user", "assistant", "tool")
        if m["role"] == "assistant":
            assert {"reasoning_content", "content"} <= set(m)
            for c in m.get("tool_calls", []):
                assert set(c) == {"id", "type", "function"} and isinstance(c["function"]["arguments"], str)


def test_the_row_carries_the_tool_results_as_the_sandbox_gave_them(tmp_path, sandboxes):
    s, recs, _, _ = synthesized(tmp_path, sandboxes, "files", "max")
    row = to_chat(recs)
    tool_msgs = [m["content"] for m in row["messages"] if m["role"] == "tool"]
    assert tool_msgs == [r["result"]["output"] for r in recs if r["type"] == "tool"]
    spec = FAMILIES["files"].spec(0)
    assert tool_msgs[0] == f"exit code 0\n{spec['out']}\n"
    assert row["meta"] == {"task": "files-0", "reward": 1.0, "effort": "max"}  # without meta: the row's own


def test_an_answer_row_has_no_tools_and_ends_with_the_reply(tmp_path, sandboxes, fmt):
    s, recs, requests, _ = synthesized(tmp_path, sandboxes, "arith", "high", seed=3)
    row = to_chat(recs)
    assert row["tools"] == [] and [m["role"] for m in row["messages"]] == ["system", "user", "assistant"]
    assert row["messages"][-1]["content"] == str(FAMILIES["arith"].spec(3)["answer"])
    assert fmt.render(row["messages"][:2], tools=row["tools"], reasoning_effort="high") == \
        render_prompt(fmt, requests[0])


def test_episodes_without_one_conversation_are_refused(tmp_path, sandboxes):
    s, recs, _, _ = synthesized(tmp_path / "mem", sandboxes, "files", "high",
                                harness=HarnessConfig(memory=True).as_dict())
    with pytest.raises(K3Error, match="harness memory was on"):
        to_chat(recs)
    s, recs, _, _ = synthesized(tmp_path / "small", sandboxes, "files", "high", context_tokens=300)
    with pytest.raises(K3Error, match="compacted the context before turn"):
        to_chat(recs)
    switched = recs[:1] + [{"type": "switch", "t": 0.0, "from": "a", "to": "b", "model": {}}] + recs[1:]
    with pytest.raises(K3Error, match="switched providers"):
        to_chat(switched)
    with pytest.raises(K3Error, match="starts with a header"):
        to_chat(recs[1:])
    # the control: the same task, canonical harness and the default context, converts
    s, recs, _, _ = synthesized(tmp_path / "ok", sandboxes, "files", "high")
    assert to_chat(recs)["meta"]["reward"] == 1.0


def test_rows_per_turn_of_a_compacted_episode_are_what_each_turn_was_sent(tmp_path, sandboxes, fmt):
    """A chain episode under a randomized harness, compacted down to whole dropped turns: row k is
    the request the harness sent for turn k (as the provider received it), then turn k, and only
    turn k carries loss; every=3 keeps turns 2, 5, 8, ... and the last."""
    harness = {**HarnessConfig.from_seed(5).as_dict(), "memory": False, "context_strategy": "sliding_window"}
    s, recs, requests, out = synthesized(tmp_path, sandboxes, "chain6", "max", harness=harness,
                                         context_tokens=500)
    assert s["score"] == 1.0
    with pytest.raises(K3Error, match="compacted the context before turn"):
        to_chat(recs)  # no single conversation: the whole-episode row is refused
    rows = to_turn_chats(out, {"family": "chain6"})
    assert len(rows) == len(requests) == 14  # 6 reads, 6 writes, submit, the closing reply
    elided = 0
    for k, (row, req) in enumerate(zip(rows, requests)):
        msgs = row["messages"]
        assert [{kk: v for kk, v in m.items() if kk != "weight"} for m in msgs[:-1]] == req.messages
        assert estimate_tokens(req.messages) <= 500 or k == 0
        assert row["meta"] == {"family": "chain6", "turn": k, "task": "chain6-0", "reward": 1.0, "effort": "max"}
        elided += any(m["role"] == "user" and m["content"].startswith(ELIDED_NOTE.split("{")[0]) for m in msgs)
        prompt = fmt.render(msgs[:-1], tools=row["tools"], reasoning_effort="max")
        assert prompt == render_prompt(fmt, req)
        ids, mask = fmt.render_for_training(msgs, tools=row["tools"], reasoning_effort="max")
        assert ids[:len(prompt)] == prompt and sum(mask[:len(prompt)]) == 0  # no loss on the context
        assert all(mask[len(prompt):]) and ids[-1] == fmt.end_id  # all of turn k's body
    assert elided >= 5  # the last turns were sent with the oldest dropped whole
    assert [r["meta"]["turn"] for r in to_turn_chats(recs, every=3)] == [2, 5, 8, 11, 13]
    # a turn whose recorded context does not rebuild is refused, naming it
    bad = [dict(r, metadata={**r["metadata"], "sent_tokens": 7}) if r["type"] == "turn" and r["index"] == 4 else r
           for r in recs]
    with pytest.raises(K3Error, match="turn 4's context rebuilds to .* but the harness recorded 7"):
        to_turn_chats(bad)
    with pytest.raises(K3Error, match="every must be an int >= 1"):
        to_turn_chats(recs, every=0)


def test_rows_per_turn_carry_the_memory_note_each_turn_was_sent(tmp_path, sandboxes, fmt):
    """Harness memory on (a note re-sent last, changing each turn): to_chat refuses the episode, and
    each per-turn row is the request as sent, note included; a trajectory without the recorded
    note is refused."""
    harness = {**HarnessConfig.from_seed(2).as_dict(), "memory": True}
    s, recs, requests, _ = synthesized(tmp_path, sandboxes, "files", "high", harness=harness)
    assert s["score"] == 1.0
    with pytest.raises(K3Error, match="harness memory was on"):
        to_chat(recs)
    rows = to_turn_chats(recs)
    assert len(rows) == len(requests) >= 3
    notes = [row["messages"][-2]["content"] for row in rows]
    assert all(n.startswith("Notes kept by the harness") for n in notes) and len(set(notes)) == len(notes)
    for row, req in zip(rows, requests):
        assert [{k: v for k, v in m.items() if k != "weight"} for m in row["messages"][:-1]] == req.messages
    stripped = [dict(r, metadata={k: v for k, v in r["metadata"].items() if k != "memory"}) if r["type"] == "turn"
                else r for r in recs]
    with pytest.raises(K3Error, match="turn 0 records no memory note"):
        to_turn_chats(stripped)


@pytest.mark.slow
def test_the_local_engine_itself_renders_those_prompts(tmp_path, sandboxes, make_nano_checkpoint):
    """The real LocalEngine (a nano model) reports as prompt tokens the length of each row prompt."""
    from k3.agent.providers import LocalEngine, ProviderRequest
    from k3.infer.engine import Engine

    text = " ".join(json.dumps(FAMILIES[n].solve(FAMILIES[n].spec(s), "max")) for n in ("arith", "files")
                    for s in range(4)) + json.dumps(TOOL_SPECS)
    _, model, tok = make_nano_checkpoint(tmp_path / "nano", text)
    fmt = ChatFormat(tok)
    s, recs, requests, _ = synthesized(tmp_path, sandboxes, "files", "max")
    row = to_chat(recs)
    starts = [i for i, m in enumerate(row["messages"]) if m["role"] == "assistant"]
    with Engine(model, tokenizer=tok) as eng:
        p = LocalEngine(eng, name="nano")
        for i, req in zip(starts, requests):
            want = len(fmt.render(row["messages"][:i], tools=row["tools"], reasoning_effort="max"))
            r = p.complete(ProviderRequest(req.messages, req.tools, req.cfg, max_tokens=1, effort=req.effort))
            assert r.usage["prompt_tokens"] == want


def test_a_header_without_the_conditions_is_refused_naming_the_field():
    end = {"type": "end", "t": 1.0, "score": 1.0}
    with pytest.raises(K3Error, match="'conditions' is missing"):
        to_chat([{"type": "header", "t": 0.0, "version": 1}, end])
    with pytest.raises(K3Error, match="conditions.prompt must hold"):
        to_chat([{"type": "header", "t": 0.0, "version": 1, "task": {"id": "x"},
                  "conditions": {"model": {}, "harness": {}, "tools": [], "prompt": {}, "context_tokens": 1}}, end])
