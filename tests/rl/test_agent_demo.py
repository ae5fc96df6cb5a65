"""The agent demo's pipeline at toy scale (nano model, a few seeds, a few steps): every stage runs
for real (synthesis in sandboxes, SFT, held-out episodes with the LocalEngine) and the report
counts what the trajectories hold."""

import json

import pytest

from k3.cli.agent_demo import AgentDemo, episode_stats, evaluate_heldout
from k3.tasks.families import FAMILIES


@pytest.mark.slow
def test_agent_demo_pipeline_end_to_end(tmp_path, make_nano_checkpoint, env_root):
    text = "What is 12 + 30? Count the lines of names.txt. def f(x): return x\n"
    base, _, _ = make_nano_checkpoint(tmp_path / "nano", text)
    demo = AgentDemo(base, tmp_path / "out", {"arith": 2, "files": 1, "code": 1}, heldout=1, control=1,
                     steps=2, batch_size=2, seq_len=1024, lr=1e-3, workers=1, max_tokens=8, threads=1,
                     results=tmp_path / "results.jsonl")
    report = demo.run(log=lambda *a: None)
    cells = report["cells"]
    assert [(c["model"], c["family"]) for c in cells] == \
        [("sft", f) for f in FAMILIES for _ in range(3)] + [("base", f) for f in FAMILIES]
    for c in cells:
        assert c["tasks"] == 1 and 0 <= c["pass_rate"] <= 1 and c["well_formed"] <= c["turns"]
        assert not c["errors"], c
    # the counts are the trajectories' own
    one = tmp_path / "out" / "eval" / "sft" / "arith-1000000.low.jsonl"
    st = episode_stats(one)
    recs = [json.loads(line) for line in one.read_text().splitlines()]
    assert st["turns"] == sum(r["type"] == "turn" for r in recs) >= 1
    sft = report["sft"]  # 12 conversations; the agent ones outgrow 1024 tokens of the toy byte-level vocabulary
    assert sft["train_conversations"] + sft["val_conversations"] + sft["dropped"] == 12, json.dumps(sft)
    assert sft["train_conversations"] >= 6 and sft["truncated"] >= sft["dropped"]
    lines = (tmp_path / "results.jsonl").read_text().splitlines()
    assert len(lines) == len(cells) and all(json.loads(x)["machine"] and json.loads(x)["date"] for x in lines)
    # the same held-out evaluation under a randomized harness (the RL demo's spread): its episodes
    # record that harness seed; the canonical ones (control) record none
    seeded = evaluate_heldout(base, tmp_path / "out", ("low",), 1, "base", 1, 8, harness=3)
    assert [(c["family"], c["harness"], c["tasks"]) for c in seeded] == [(f, 3, 1) for f in FAMILIES]
    hs = json.loads((tmp_path / "out" / "eval" / "base-h3" / "arith-1000000.low.jsonl").read_text().splitlines()[0])
    assert hs["conditions"]["harness"]["seed"] == 3
    assert json.loads(one.read_text().splitlines()[0])["conditions"]["harness"]["seed"] is None


def test_episode_stats_counts_malformed_turns(tmp_path):
    """A turn cut at max_tokens and a turn whose tool call was unknown are not well formed; a turn
    that stopped at <|im_end|> with known tools is (positive control)."""
    def rec(**k):
        return json.dumps(k) + "\n"
    p = tmp_path / "t.jsonl"
    p.write_text(
        rec(type="header", version=1)
        + rec(type="turn", index=0, tool_calls=[{"name": "shell"}], metadata={"finish_reason": "tool_calls"})
        + rec(type="tool", turn=0, result={"meta": {}})
        + rec(type="turn", index=1, tool_calls=[{"name": "nope"}], metadata={"finish_reason": "tool_calls"})
        + rec(type="tool", turn=1, result={"meta": {"bad_call": True}})
        + rec(type="turn", index=2, tool_calls=[], metadata={"finish_reason": "length"})
        + rec(type="turn", index=3, tool_calls=[], reasoning="think", metadata={"finish_reason": "stop"}))
    assert episode_stats(p) == {"turns": 4, "well_formed": 2, "tool_calls": 2, "reasoning_chars": 5}
