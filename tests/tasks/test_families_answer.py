"""The task format's ``answer`` field: the final reply (no tool call) is submitted as that file and
judged by the same clean-room verifier; bad values are refused naming the field; a task with no
tools works through the harness; the submission budget applies; replay reproduces it."""

import pytest

from k3.agent.randomize import ANSWER_NOTE, ANSWER_PROMPTS, PROMPT_TEMPLATES
from k3.errors import ConfigError
from k3.rl.rollout import replay
from k3.tasks.families import FAMILIES
from k3.tasks.families.base import answer_verifier
from k3.tasks.format import load_task
from test_families import episode

TOML = '''id = "ask"
kind = "data"
goal = "What is 2 + 2? Reply with the number only."
submit = ["answer.txt"]
{answer}
[budget]
submissions = {subs}

[tools]
allowed = {tools}
'''


def make(tmp_path, answer='answer = "answer.txt"', tools="[]", subs=1):
    d = tmp_path / "ask"
    (d / "workspace").mkdir(parents=True, exist_ok=True)
    (d / "verifier").mkdir(exist_ok=True)
    (d / "verifier" / "verify.py").write_text(answer_verifier("answer.txt", ["4"]))
    (d / "task.toml").write_text(TOML.format(answer=answer, tools=tools, subs=subs))
    return d


def test_the_reply_is_the_submission_and_the_verifier_judges_it(tmp_path, sandboxes):
    d = make(tmp_path)
    assert load_task(d).answer == "answer.txt" and load_task(d).allowed_tools == []
    s, recs = episode(d, [{"reasoning": "2 + 2 = 4.", "content": "4"}], sandboxes)
    assert (s["score"], s["submissions"], s["steps"]) == (1.0, 1, 0)
    sub = [r for r in recs if r["type"] == "submission"]
    assert [(r["accepted"], r["source"]) for r in sub] == [(True, "answer")]
    files = sub[0]["manifest"]["files"]
    assert list(files) == ["answer.txt"] and files["answer.txt"]["bytes"] == 1
    head = recs[0]["conditions"]
    assert head["tools"] == [] and head["prompt"]["system"] == ANSWER_PROMPTS[0]
    # the positive control: a wrong reply, the same path, scores 0 with the verifier's reason
    s, _ = episode(d, [{"reasoning": "2 + 2 = 5.", "content": "5"}], sandboxes)
    assert s["score"] == 0.0 and "wrong answer in answer.txt: '5'" in s["verdicts"][0]["reason"]


def test_an_episode_that_ends_on_a_tool_call_submits_no_reply(tmp_path, sandboxes):
    d = make(tmp_path, tools='["shell"]')
    s, recs = episode(d, [{"content": "4", "tool_calls": [{"name": "shell", "arguments": {"command": "true"}}]}],
                      sandboxes)
    assert (s["score"], s["submissions"]) == (0.0, 0)  # the transcript ran out after a call: no reply
    assert recs[0]["conditions"]["prompt"]["system"] == (PROMPT_TEMPLATES[0].format(
        workdir="/workspace", submit="submit", submissions=1) + "\n" + ANSWER_NOTE.format(answer="answer.txt"))
    s, _ = episode(d, [{"tool_calls": [{"name": "shell", "arguments": {"command": "true"}}]}, {"content": "4"}],
                   sandboxes)
    assert (s["score"], s["submissions"]) == (1.0, 1)


def test_the_reply_counts_against_the_submission_budget(tmp_path, sandboxes):
    d = make(tmp_path, tools='["write", "submit"]')
    turns = [{"tool_calls": [{"name": "write", "arguments": {"path": "answer.txt", "content": "5"}},
                             {"name": "submit", "arguments": {}}]}, {"content": "4"}]
    s, recs = episode(d, turns, sandboxes)
    sub = [r for r in recs if r["type"] == "submission"]
    assert [(r["accepted"], r["source"]) for r in sub] == [(True, "submit"), (False, "answer")]
    assert sub[1]["reason"] == "submission budget exhausted" and s["score"] == 0.0
    d2 = make(tmp_path / "two", tools='["write", "submit"]', subs=2)  # with room, the last (the reply) is scored
    s, _ = episode(d2, turns, sandboxes)
    assert (s["submissions"], s["score"]) == (2, 1.0)


def test_tools_in_an_answer_task_refuse_calls_of_tools_it_does_not_allow(tmp_path, sandboxes):
    d = make(tmp_path)
    s, recs = episode(d, [{"tool_calls": [{"name": "shell", "arguments": {"command": "echo 4 > answer.txt"}}]},
                          {"content": "4"}], sandboxes)
    pol = [r for r in recs if r["type"] == "policy"]
    assert [(p["allowed"], p["rule"]) for p in pol] == [(False, "budget")]
    assert s["score"] == 1.0  # the reply, not the refused shell call, made answer.txt


@pytest.mark.parametrize("line,match", [
    ('answer = "/abs.txt"', "answer must be a relative file path"),
    ('answer = "../answer.txt"', "answer must be a relative file path"),
    ('answer = ""', "answer must be a relative file path"),
    ('answer = "a//answer.txt"', "answer must be a relative file path"),
    ("answer = 3", "answer must be a relative file path"),
    ('answer = ["answer.txt"]', "answer must be a relative file path"),
    ('answer = "reply.txt"', "answer 'reply.txt' is not selected by any submit glob"),
])
def test_a_bad_answer_value_is_refused_naming_the_field(tmp_path, line, match):
    d = make(tmp_path, answer=line)
    with pytest.raises(ConfigError, match=match):
        load_task(d)
    make(tmp_path)  # the positive control: the same task with a good value loads
    assert load_task(d).answer == "answer.txt"


def test_no_tools_needs_an_answer_and_tools_must_be_known_and_distinct(tmp_path):
    d = make(tmp_path, answer="")
    with pytest.raises(ConfigError, match=r"allowed = \[\] needs 'answer'"):
        load_task(d)
    make(tmp_path, tools='["shell", "shell"]')
    with pytest.raises(ConfigError, match="allowed must be a list of distinct tools"):
        load_task(d)
    make(tmp_path, answer="", tools='["shell"]')
    assert load_task(d).answer is None  # tools without an answer: as before


def test_replay_reproduces_an_answer_episode(tmp_path, sandboxes):
    from k3.agent.providers import Scripted
    from k3.rl.rollout import run_episode
    from k3.rl.trajectory import TrajectoryWriter

    fam = FAMILIES["arith"]
    d = fam.generate(4, tmp_path)
    out = tmp_path / "t.jsonl"
    w = TrajectoryWriter(out)
    run_episode(d, Scripted(fam.solve(d, "max")), w, sandboxes=sandboxes, effort="max")
    w.close()
    rep = replay(out)
    assert rep.ok and rep.score == rep.recorded_score == 1.0 and rep.compared["submission"] == 1
