"""Rollouts in real namespace sandboxes: budgets (submissions refused and logged, wall time stops
and scores 0), best/last scoring, randomization recorded, replay reproduces, pool and Ray run the
same function with the same results."""

import json
import time

import pytest

from k3.agent.providers import Scripted
from k3.agent.randomize import HarnessConfig
from k3.cli.task import task_main
from k3.rl.rollout import run_episode, run_jobs
from k3.rl.rollout import replay
from k3.rl.trajectory import TrajectoryWriter, read_trajectory
from k3.tasks.format import load_task
from taskdirs import FIXED, make_task, write_transcript

FIX = {"name": "write", "arguments": {"path": "calc.py", "content": FIXED}}
BREAK = {"name": "write", "arguments": {"path": "calc.py", "content": "def add(a, b):\n    return 4\n"}}
SUBMIT = {"name": "submit", "arguments": {}}


def episode(d, turns, sandboxes, **kw):
    w = TrajectoryWriter()
    s = run_episode(d, Scripted(turns), w, sandboxes=sandboxes, **kw)
    return s, w.records


def test_submissions_beyond_the_budget_are_refused_and_logged(tmp_path, sandboxes):
    d = make_task(tmp_path, submissions=2)
    s, recs = episode(d, [{"tool_calls": [FIX, SUBMIT, SUBMIT, SUBMIT, SUBMIT]}], sandboxes)
    subs = [r for r in recs if r["type"] == "submission"]
    assert [r["accepted"] for r in subs] == [True, True, False, False]
    assert all(r["reason"] == "submission budget exhausted" for r in subs[2:])
    pol = [r for r in recs if r["type"] == "policy" and r["tool"] == "submit"]
    assert [(p["allowed"], p["rule"]) for p in pol] == [(True, "default")] * 2 + [(False, "budget")] * 2
    tool = [r["result"] for r in recs if r["type"] == "tool" and r["name"] == "submit"]
    assert [t["error"] for t in tool] == [False, False, True, True]
    assert (s["submissions"], s["refused_submissions"], s["score"]) == (2, 2, 1.0)
    assert [r["submission"] for r in recs if r["type"] == "verdict"] == [0]  # best-of stops at a 1.0


def test_over_the_wall_time_budget_the_episode_is_stopped_and_scored_zero(tmp_path, sandboxes):
    slow = {"name": "shell", "arguments": {"command": "sleep 30"}}
    d = make_task(tmp_path / "a", wall=2)
    t0 = time.monotonic()
    s, recs = episode(d, [{"tool_calls": [FIX, SUBMIT, slow, SUBMIT]}], sandboxes)
    took = time.monotonic() - t0
    assert (s["status"], s["score"]) == ("wall_time_exceeded", 0.0)
    sleep = [r for r in recs if r["type"] == "tool" and r["name"] == "shell"][0]["result"]
    assert sleep["meta"]["timed_out"] and sleep["meta"]["timeout"] <= 2
    assert s["submissions"] == 1 and took < 20  # stopped at the budget, not after the 30 s sleep
    # positive control: the same episode within its budget scores the submission
    ok, _ = episode(make_task(tmp_path / "b", wall=60),
                    [{"tool_calls": [FIX, SUBMIT, {"name": "shell", "arguments": {"command": "sleep 0.1"}}]}],
                    sandboxes)
    assert (ok["status"], ok["score"]) == ("completed", 1.0)


@pytest.mark.parametrize("use,calls,rewards", [
    ("best", [BREAK, SUBMIT, FIX, SUBMIT, BREAK, SUBMIT], [0.0, 1.0]),  # verified in order until a 1.0
    ("last", [BREAK, SUBMIT, FIX, SUBMIT, BREAK, SUBMIT], [0.0]),
    ("last", [BREAK, SUBMIT, FIX, SUBMIT], [1.0])])
def test_scoring_uses_the_best_or_the_last_submission(tmp_path, sandboxes, use, calls, rewards):
    d = make_task(tmp_path, use=use, submissions=3)
    s, recs = episode(d, [{"tool_calls": calls}], sandboxes)
    assert [r["reward"] for r in recs if r["type"] == "verdict"] == rewards
    assert s["score"] == max(rewards)


def test_harness_randomization_is_recorded_and_the_renamed_tools_still_solve_the_task(tmp_path, sandboxes):
    d = make_task(tmp_path)
    turns = json.loads((d / "solution" / "solve.json").read_text())["turns"]
    cfg = HarnessConfig.from_seed(7)
    assert cfg.tool_names != HarnessConfig().tool_names
    s, recs = episode(d, turns, sandboxes, harness=7, seed=7)
    head = recs[0]
    assert head["type"] == "header" and head["conditions"]["harness"] == cfg.as_dict()
    allowed = load_task(d).allowed_tools
    assert {t["function"]["name"] for t in head["conditions"]["tools"]} == {cfg.tool_names[t] for t in allowed}
    assert head["conditions"]["prompt"]["system"] == cfg.system_prompt("/workspace", 2)
    sent = [c["name"] for r in recs if r["type"] == "turn" for c in r["tool_calls"]]
    assert sent == [cfg.tool_names[c["name"]] for t in turns for c in t["tool_calls"]]
    canonical = [r["name"] for r in recs if r["type"] == "tool"]
    assert canonical == [c["name"] for t in turns for c in t["tool_calls"]]
    assert s["score"] == 1.0


def test_a_denied_call_is_answered_and_logged_and_the_episode_goes_on(tmp_path, sandboxes):
    d = make_task(tmp_path)
    s, recs = episode(d, [{"tool_calls": [{"name": "shell", "arguments": {"command": "ls; rm -rf /"}},
                                          {"name": "shell", "arguments": {"command": "pip install numpy"}},
                                          FIX, SUBMIT]}], sandboxes)
    pol = [(r["action"], r["allowed"]) for r in recs if r["type"] == "policy"]
    assert pol == [("deny", False), ("ask", False), ("allow", True), ("allow", True)]
    out = [r["result"]["output"] for r in recs if r["type"] == "tool"]
    assert out[0].startswith("denied by policy (path-rules)") and "outside the workspace" in out[0]
    assert s["score"] == 1.0


def test_replay_reproduces_tool_results_and_verdict_and_notices_a_difference(tmp_path, sandboxes, capsys):
    d = make_task(tmp_path)
    sol = d / "solution" / "solve.json"
    traj = tmp_path / "run.jsonl"
    assert task_main(["run", str(d), "--transcript", str(sol), "--seed", "3", "--out", str(traj)]) == 0
    assert "score 1.000" in capsys.readouterr().out
    recs = read_trajectory(traj)
    assert recs[-1]["type"] == "end" and recs[0]["conditions"]["harness"]["seed"] == 3
    assert task_main(["replay", str(traj)]) == 0
    out = capsys.readouterr().out
    assert "replay: reproduced (4 tool, 4 policy, 1 submission, 1 verdict, 1 end)" in out
    # a recording whose tool output differs from what the sandbox gives is reported, exit 1
    lines = traj.read_text().splitlines()
    k = next(i for i, x in enumerate(lines) if json.loads(x)["type"] == "tool")
    rec = json.loads(lines[k])
    rec["result"]["output"] = "something else"
    lines[k] = json.dumps(rec)
    bad = tmp_path / "tampered.jsonl"
    bad.write_text("\n".join(lines) + "\n")
    rep = replay(bad)
    assert not rep.ok and rep.mismatches[0].startswith("tool[0]")
    (d / "verifier" / "verify.py").write_text("print('changed')\n")
    with pytest.raises(Exception, match="task changed"):
        replay(traj)


@pytest.mark.slow
def test_pool_and_ray_run_the_same_rollouts_with_the_same_results(tmp_path, sandboxes):
    d = make_task(tmp_path)
    hack = d / "hacks" / "hardcode.json"
    jobs = [{"task": str(d), "provider": {"kind": "scripted", "transcript": str(p)}, "label": p.stem,
             "backend": "namespace", "out": str(tmp_path / f"{p.stem}.jsonl")}
            for p in (d / "solution" / "solve.json", hack)]
    two = run_jobs(jobs, workers=2)
    ray = run_jobs(jobs, workers=2, use_ray=True)
    for res in (two, ray):
        assert [(r["label"], r["score"], r["status"]) for r in res] == [("solve", 1.0, "completed"),
                                                                        ("hardcode", 0.0, "completed")]
    assert replay(tmp_path / "solve.jsonl").ok  # the Ray worker's trajectory replays here
    write_transcript(tmp_path / "x.json", [])  # one worker (in process); an empty transcript scores 0
    none = run_jobs([{**jobs[0], "provider": {"kind": "scripted", "transcript": str(tmp_path / "x.json")},
                      "out": None}, {**jobs[0], "provider": {"kind": "scripted", "transcript": "/nonexistent.json"}}],
                    workers=1)
    assert [(r["score"], r["status"]) for r in none] == [(0.0, "completed"), (0.0, "error")]
    assert none[0]["submissions"] == 0 and "nonexistent.json" in none[1]["detail"]


def test_k3_task_run_ask_answers_on_the_terminal(tmp_path, monkeypatch, capsys, sandboxes):
    d = make_task(tmp_path)
    pip = {"name": "shell", "arguments": {"command": "pip --version > /dev/null; pip3 install nothing-at-all"}}
    tr = write_transcript(tmp_path / "t.json", [{"tool_calls": [pip, pip]}])
    answers = iter(["y", "n"])
    monkeypatch.setattr("builtins.input", lambda prompt: next(answers))
    assert task_main(["run", str(d), "--transcript", str(tr), "--ask", "--out", str(tmp_path / "a.jsonl")]) == 0
    assert capsys.readouterr().out.count("policy asks: shell") == 2
    pol = [r for r in read_trajectory(tmp_path / "a.jsonl") if r["type"] == "policy"]
    assert [(p["action"], p["allowed"], p["approval"]) for p in pol] == [("ask", True, "approved"),
                                                                       ("ask", False, "denied")]
