"""``k3 task gen`` and ``k3 task synth`` end to end (real sandboxes), and their one-line errors."""

import json

import pytest

from k3.cli import main
from k3.data.chat import ChatFormat
from k3.data.tokenizer import train_tokenizer
from k3.cli.task import task_main
from k3.agent.harness import estimate_tokens
from k3.agent.randomize import HarnessConfig
from k3.rl.synth import parse_efforts, parse_seeds
from k3.tasks.families import HELDOUT_START, read_meta
from k3.tasks.families.arith import Arith
from k3.tasks.families.files import Files
from k3.tasks.format import validate_task


def one_line_error(capsys, argv, match):
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and match in err, err
    return err


def test_gen_writes_valid_tasks_of_both_splits_and_refuses_to_overwrite(tmp_path, capsys):
    out = tmp_path / "tasks"
    assert main(["task", "gen", "files", "--seeds", "0:3", "--out", str(out)]) == 0
    assert main(["task", "gen", "files", "--seeds", str(HELDOUT_START), "--out", str(out)]) == 0
    assert "1 held out" in capsys.readouterr().out
    names = sorted(p.name for p in out.iterdir())
    assert names == ["files-0", "files-1", "files-1000000", "files-2"]
    assert [read_meta(out / n)["split"] for n in names] == ["train", "train", "heldout", "train"]
    assert task_main(["validate", str(out)]) == 0
    for n in names:
        validate_task(out / n)
    one_line_error(capsys, ["task", "gen", "files", "--seeds", "2:5", "--out", str(out)], "exists and is not empty")
    assert not (out / "files-3").exists()  # checked before anything was written
    before = (out / "files-0" / "task.toml").read_bytes()
    assert main(["task", "gen", "files", "--seeds", "0:4", "--out", str(out), "--overwrite"]) == 0
    assert (out / "files-0" / "task.toml").read_bytes() == before and (out / "files-3").is_dir()


@pytest.mark.parametrize("seeds", ["5:2", "3:3", "-1:4", "a:b", "1:x", ""])
def test_a_bad_seed_range_is_one_line_and_exit_2(tmp_path, capsys, seeds):
    for cmd in ("gen", "synth"):
        argv = ["task", cmd, "arith", f"--seeds={seeds}", "--out", str(tmp_path / "x")]
        one_line_error(capsys, argv, "--seeds must be A:B")
    assert not (tmp_path / "x").exists()


def test_a_bad_family_effort_or_backend_is_one_line_and_exit_2(tmp_path, capsys):
    out = str(tmp_path / "x")
    one_line_error(capsys, ["task", "gen", "arithmetic", "--seeds", "0:2", "--out", out], "did you mean 'arith'")
    one_line_error(capsys, ["task", "synth", "cod", "--seeds", "0:2", "--out", out], "did you mean 'code'")
    one_line_error(capsys, ["task", "synth", "code", "--seeds", "0:2", "--effort", "medium", "--out", out],
                   "--effort must be one of low, high, max or all")
    one_line_error(capsys, ["task", "synth", "code", "--seeds", "0:2", "--backend", "local", "--out", out],
                   "cannot run on the 'local' backend")
    assert not (tmp_path / "x").exists()


def test_seed_and_effort_parsing():
    assert parse_seeds("3:6") == range(3, 6) and parse_seeds("7") == range(7, 8)
    assert parse_efforts(None) == ["low", "high", "max"] == parse_efforts(["all"])
    assert parse_efforts(["max", "low", "max"]) == ["max", "low"]


def test_synth_writes_one_row_per_passing_episode(tmp_path, sandboxes, capsys):
    out = tmp_path / "sft" / "code.jsonl"
    tasks = tmp_path / "tasks"
    argv = ["task", "synth", "code", "--seeds", "0:2", "--effort", "low", "--effort", "max", "--out", str(out),
            "--tasks-dir", str(tasks)]
    assert main(argv) == 0
    assert "synth: 4 row(s) from 4 episode(s)" in capsys.readouterr().out
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert [(r["meta"]["seed"], r["meta"]["effort"]) for r in rows] == [(0, "low"), (0, "max"), (1, "low"), (1, "max")]
    assert all(r["meta"]["family"] == "code" and r["meta"]["domain"] == "coding_agent" and r["meta"]["reward"] == 1.0
               and r["meta"]["split"] == "train" and r["reasoning_effort"] == r["meta"]["effort"] for r in rows)
    assert sorted(p.name for p in tasks.iterdir()) == ["code-0", "code-1"]  # kept where asked
    tok = train_tokenizer([out.read_text()], vocab_size=600)
    fmt = ChatFormat(tok)
    for r in rows:
        ids, mask = fmt.render_for_training(r["messages"], tools=r["tools"], reasoning_effort=r["reasoning_effort"])
        assert 0 < sum(mask) < len(ids)
    one_line_error(capsys, argv, "exists (--overwrite replaces it)")
    assert main(argv + ["--overwrite", "--effort", "high"]) == 0
    assert len(out.read_text().splitlines()) == 6


def test_synth_per_turn_rows_of_short_chains_under_compaction(tmp_path, sandboxes, capsys):
    """chainN is a family name; --per-turn 2 --context-tokens 400: one row per second turn (and the
    last), each trains one assistant turn and stays under the limit; the whole-episode rows of the
    same chains are the control (one per episode, every turn trained)."""
    out = tmp_path / "c.jsonl"
    argv = ["task", "synth", "chain8", "--seeds", "0:2", "--effort", "max", "--out", str(out)]
    assert main(argv + ["--per-turn", "2", "--context-tokens", "400"]) == 0
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(rows) == 2 * 9  # 18 turns per episode (8 reads, 8 writes, submit, reply): 1, 3, ..., 17
    assert [r["meta"]["turn"] for r in rows[:9]] == list(range(1, 18, 2))
    tok = train_tokenizer([out.read_text()], vocab_size=600)
    fmt = ChatFormat(tok)
    for r in rows:
        assert r["meta"]["family"] == "chain8" and r["meta"]["split"] == "train"
        assert estimate_tokens(r["messages"][:-1]) <= 400 or r["meta"]["turn"] < 4
        assert sum(m["role"] == "assistant" and m.get("weight", 1) == 1 for m in r["messages"]) == 1
        ids, mask = fmt.render_for_training(r["messages"], tools=r["tools"], reasoning_effort="max")
        assert 0 < sum(mask) < len(ids) / 4
    assert any("dropped to save context" in json.dumps(r["messages"]) for r in rows)
    assert main(argv + ["--overwrite"]) == 0  # the control: whole episodes, far over the limit
    whole = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(whole) == 2 and estimate_tokens(whole[0]["messages"]) > 2 * 400
    one_line_error(capsys, argv + ["--overwrite", "--context-tokens", "400"], "need per_turn")
    one_line_error(capsys, argv + ["--overwrite", "--harness-seeds", "1:3"], "need per_turn")
    one_line_error(capsys, argv + ["--overwrite", "--per-turn", "1", "--harness-seeds", "3:1"],
                   "--harness-seeds must be A:B")
    one_line_error(capsys, argv + ["--overwrite", "--per-turn", "0", "--context-tokens", "9"], "per_turn must be an int >= 1")
    one_line_error(capsys, argv + ["--overwrite"] + ["--per-turn", "1", "--context-tokens", "0"],
                   "context_tokens must be an int >= 1")
    one_line_error(capsys, ["task", "synth", "chain0", "--seeds", "0:2", "--out", str(tmp_path / "y")],
                   "chain steps must be an int in 1..999")


def test_synth_under_randomized_harnesses_uses_each_rooms_tool_names(tmp_path, sandboxes):
    """--harness-seeds 1:4: episode (seed, effort j) runs under harness seed 1 + (3·seed + j) mod 3; its
    rows call that harness's tool names and carry its system prompt and memory note when it has one;
    the canonical rows of the same tasks (the control) call the canonical names."""
    out = tmp_path / "r.jsonl"
    assert main(["task", "synth", "files", "--seeds", "0:2", "--out", str(out), "--per-turn", "1",
                 "--harness-seeds", "1:4"]) == 0
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    want = {(s, e): 1 + (3 * s + j) % 3 for s in range(2) for j, e in enumerate(("low", "high", "max"))}
    assert {(r["meta"]["seed"], r["meta"]["effort"]): r["meta"]["harness"] for r in rows} == want
    for r in rows:
        cfg = HarnessConfig.from_seed(r["meta"]["harness"])
        names = {c["function"]["name"] for m in r["messages"] if m["role"] == "assistant"
                 for c in m.get("tool_calls", [])}
        assert names <= {cfg.tool_names[t] for t in ("shell", "write", "submit")}
        assert [t["function"]["name"] for t in r["tools"]] == [cfg.tool_names[t] for t in ("shell", "write", "submit")]
        assert (r["messages"][-2]["content"].startswith("Notes kept by the harness")) == cfg.memory
    assert {HarnessConfig.from_seed(h).memory for h in want.values()} == {True, False}  # both kinds covered
    assert main(["task", "synth", "files", "--seeds", "0:2", "--out", str(out), "--overwrite", "--per-turn", "1"]) == 0
    canon = {c["function"]["name"] for x in out.read_text().splitlines() for m in json.loads(x)["messages"]
             if m["role"] == "assistant" for c in m.get("tool_calls", [])}
    assert canon == {"shell", "write", "submit"}


@pytest.mark.slow
def test_synth_every_family_and_effort_in_a_temporary_folder(tmp_path, sandboxes, capsys):
    for fam in ("arith", "files", "code"):
        out = tmp_path / f"{fam}.jsonl"
        assert main(["task", "synth", fam, "--seeds", f"{HELDOUT_START}:{HELDOUT_START + 2}", "--out", str(out),
                     "--workers", "2"]) == 0
        rows = [json.loads(x) for x in out.read_text().splitlines()]
        assert [r["meta"]["effort"] for r in rows] == ["low", "high", "max"] * 2
        assert {r["meta"]["split"] for r in rows} == {"heldout"}


class OddSeedsWrong(Arith):
    """arith whose solver answers one too many on odd seeds (a real family, registered for the test)."""

    name = "arith-odd-wrong"

    def turns(self, spec, effort):
        turns = super().turns(spec, effort)
        if spec["a"] % 2:
            turns[-1] = {**turns[-1], "content": str(spec["answer"] + 1)}
        return turns


class ClaimsOtherOutputs(Files):
    """files whose solver assumes a tool result the sandbox will not give on seed 1."""

    name = "files-other"

    def expected_outputs(self, spec, effort):
        want = super().expected_outputs(spec, effort)
        return ["exit code 0\nsomething else\n"] + want[1:] if spec == self.spec(1) else want


def test_synth_keeps_only_passing_consistent_episodes_and_reports_the_rest(tmp_path, sandboxes, capsys, monkeypatch):
    from k3.tasks import families

    odd = OddSeedsWrong()
    monkeypatch.setitem(families.FAMILIES, odd.name, odd)
    seeds = [s for s in range(12) if odd.spec(s)["a"] % 2][:1] + [s for s in range(12) if not odd.spec(s)["a"] % 2][:1]
    out = tmp_path / "a.jsonl"
    for s in seeds:
        assert main(["task", "synth", odd.name, "--seeds", str(s), "--effort", "low", "--out", str(out),
                     "--overwrite"]) == (1 if odd.spec(s)["a"] % 2 else 0)
        text = capsys.readouterr().out
        if odd.spec(s)["a"] % 2:
            assert f"FAIL {odd.name}-{s} low: score 0.0 (completed): wrong answer in answer.txt" in text
            assert "0 row(s) from 1 episode(s)" in text and out.read_text() == ""
        else:
            assert "1 row(s) from 1 episode(s)" in text and len(out.read_text().splitlines()) == 1
    other = ClaimsOtherOutputs()
    monkeypatch.setitem(families.FAMILIES, other.name, other)
    assert main(["task", "synth", other.name, "--seeds", "0:2", "--effort", "high", "--out", str(out),
                 "--overwrite"]) == 1
    text = capsys.readouterr().out
    assert f"FAIL {other.name}-1 high: inconsistent: tool result 0 is" in text and "1 failed" in text
    assert [json.loads(x)["meta"]["seed"] for x in out.read_text().splitlines()] == [0]
