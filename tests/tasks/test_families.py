"""Task families (k3.tasks.families): deterministic generation, the train/held-out split, valid
tasks, the scripted solver passing the hidden verifier at every effort through the real harness and
namespace sandbox (and a wrong answer or broken function scoring 0 the same way), and effort that
is real (longer reasoning, and at max a check)."""

import json
from pathlib import Path

import pytest

from k3.agent.providers import Scripted
from k3.data.chat import EFFORTS as CHAT_EFFORTS
from k3.errors import ConfigError
from k3.rl.rollout import run_episode
from k3.rl.trajectory import TrajectoryWriter
from k3.tasks.families import EFFORTS, FAMILIES, HELDOUT_START, get_family, read_meta, split_of
from k3.tasks.format import load_transcript, validate_task

NAMES = sorted(FAMILIES)


def tree(d: Path) -> dict:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def episode(task_dir, turns, sandboxes, effort=None):
    w = TrajectoryWriter()
    s = run_episode(task_dir, Scripted(turns), w, sandboxes=sandboxes, effort=effort)
    return s, w.records


def reasoning(turns) -> str:
    return "\n".join(t.get("reasoning") or "" for t in turns)


def calls(turns) -> list[dict]:
    return [c for t in turns for c in t.get("tool_calls", [])]


def test_the_registry_and_efforts():
    assert NAMES == ["arith", "code", "files"]
    assert {f.name: f.domain for f in FAMILIES.values()} == {"arith": "general", "files": "general_agent",
                                                            "code": "coding_agent"}
    assert EFFORTS == CHAT_EFFORTS
    with pytest.raises(ConfigError, match="did you mean 'files'"):
        get_family("file")
    with pytest.raises(ConfigError, match="unknown task family 'zzz'"):
        get_family("zzz")


@pytest.mark.parametrize("name", NAMES)
def test_generation_is_deterministic_and_seeds_differ(tmp_path, name):
    fam = FAMILIES[name]
    a, b = fam.generate(5, tmp_path / "a"), fam.generate(5, tmp_path / "b")
    assert a.name == b.name == f"{name}-5"
    assert tree(a) == tree(b) and len(tree(a)) >= 5
    drawn = {json.dumps([fam.instance(s).spec, fam.instance(s).workspace], sort_keys=True) for s in range(30)}
    assert len(drawn) == 30  # every seed its own instance (files may share a question, never the files too)
    assert tree(fam.generate(6, tmp_path / "a")) != tree(a)


@pytest.mark.parametrize("name", NAMES)
def test_every_generated_task_is_valid_and_records_its_split(tmp_path, name):
    fam = FAMILIES[name]
    seeds = [*range(12), HELDOUT_START - 1, HELDOUT_START, HELDOUT_START + 7]
    for seed in seeds:
        d = fam.generate(seed, tmp_path)
        t = validate_task(d)
        assert t.id == f"{name}-{seed}" and t.solution.expect_reward == 1.0
        assert t.hacks and all(h.expect_reward == 0.0 for h in t.hacks)
        meta = read_meta(d)
        assert (meta["family"], meta["seed"], meta["domain"]) == (name, seed, fam.domain)
        assert meta["split"] == ("train" if seed < HELDOUT_START else "heldout") == split_of(seed)
        assert not (d / "workspace" / "family.json").exists()  # the spec (with the answer) stays outside


def test_the_split_rule_is_disjoint_and_refuses_bad_seeds():
    train = {s for s in range(HELDOUT_START - 50, HELDOUT_START + 50) if split_of(s) == "train"}
    held = {s for s in range(HELDOUT_START - 50, HELDOUT_START + 50) if split_of(s) == "heldout"}
    assert not train & held and max(train) == HELDOUT_START - 1 and min(held) == HELDOUT_START
    for bad in (-1, 2.0, "3", True):
        with pytest.raises(ConfigError, match="seed must be an int >= 0"):
            split_of(bad)


def test_generate_refuses_an_existing_directory_unless_overwrite(tmp_path):
    fam = FAMILIES["arith"]
    d = fam.generate(1, tmp_path)
    with pytest.raises(ConfigError, match="exists and is not empty"):
        fam.generate(1, tmp_path)
    (d / "task.toml").write_text("edited")
    assert fam.generate(1, tmp_path, overwrite=True) == d and (d / "task.toml").read_text() != "edited"
    other = tmp_path / "arith-2"
    other.mkdir()
    (other / "mine.txt").write_text("not a task")
    with pytest.raises(ConfigError, match="not a generated task"):
        fam.generate(2, tmp_path, overwrite=True)
    assert (other / "mine.txt").read_text() == "not a task"


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("effort", EFFORTS)
def test_the_scripted_solver_passes_the_hidden_verifier(tmp_path, sandboxes, name, effort):
    fam = FAMILIES[name]
    for seed in (0, HELDOUT_START + 3):
        d = fam.generate(seed, tmp_path)
        turns = fam.solve(d, effort)
        s, recs = episode(d, turns, sandboxes, effort=effort)
        assert (s["score"], s["status"]) == (1.0, "completed"), s["verdicts"]
        assert recs[0]["conditions"]["effort"] == effort
        outputs = [r["result"]["output"] for r in recs if r["type"] == "tool"]
        assert fam.check_outputs(fam.spec(seed), effort, outputs) is None  # the turns agree with the real results
        assert all(not r["result"]["error"] for r in recs if r["type"] == "tool")


@pytest.mark.parametrize("name", NAMES)
def test_a_wrong_answer_scores_zero_through_the_same_path(tmp_path, sandboxes, name):
    fam = FAMILIES[name]
    d = fam.generate(0, tmp_path)
    for hack in validate_task(d).hacks:  # arith: the reply off by one; files: a wrong number; code: a bug
        s, recs = episode(d, hack.turns, sandboxes)
        assert s["submissions"] == 1 and s["score"] == 0.0, (hack.path.name, s["verdicts"])
        assert "isolation" in s["verdicts"][0]["reason"]  # a verdict of the real verifier, not a refusal
    # the control of the control: the solution's own turns through the very same task score 1.0
    assert episode(d, load_transcript(d / "solution" / "solve.json").turns, sandboxes)[0]["score"] == 1.0


def _first_seed_of_each_template(fam) -> dict:
    found = {}
    for seed in range(200):
        found.setdefault(fam.spec(seed)["template"], seed)
    return found


@pytest.mark.slow
@pytest.mark.parametrize("name", ["files", "code"])
def test_every_template_solves_at_every_effort(tmp_path, sandboxes, name):
    from k3.tasks.families import code, files

    fam = FAMILIES[name]
    found = _first_seed_of_each_template(fam)
    assert set(found) == set((files if name == "files" else code).TEMPLATES)
    for template, seed in sorted(found.items()):
        d = fam.generate(seed, tmp_path)
        for effort in EFFORTS:
            s, recs = episode(d, fam.solve(d, effort), sandboxes, effort=effort)
            outputs = [r["result"]["output"] for r in recs if r["type"] == "tool"]
            assert s["score"] == 1.0, (template, effort, s["verdicts"])
            assert fam.check_outputs(fam.spec(seed), effort, outputs) is None, (template, effort, outputs)


@pytest.mark.parametrize("name", NAMES)
def test_effort_is_real_longer_reasoning_and_a_check_at_max(name):
    fam = FAMILIES[name]
    for seed in range(40):
        spec = fam.spec(seed)
        low, high, top = (fam.solve(spec, e) for e in EFFORTS)
        assert len(reasoning(low)) < len(reasoning(high)) < len(reasoning(top)), seed
        answer = str(spec.get("answer", ""))
        if name == "arith":
            assert [t["content"] for t in low] == [t["content"] for t in top] == [answer]
            assert "Check: " in top[0]["reasoning"] and "which matches" in top[0]["reasoning"]
            assert "Check" not in high[0]["reasoning"] and "column by column" in high[0]["reasoning"]
        elif name == "files":
            shells = [c["arguments"]["command"] for c in calls(top) if c["name"] == "shell"]
            assert len(shells) == 2 and shells[0] != shells[1]  # a re-count with another command
            assert len([c for c in calls(high) if c["name"] == "shell"]) == 1
        else:
            names = [c["name"] for c in calls(top)]
            assert names == ["write", "shell", "submit"] and "python3" in calls(top)[1]["arguments"]["command"]
            assert [c["name"] for c in calls(high)] == ["write", "submit"]
            assert [c["name"] for c in top[0]["tool_calls"]] == ["write", "shell"]  # submits after the result


def test_arith_columns_are_right_for_every_carry_and_borrow_pattern():
    from k3.tasks.families.arith import columns

    for a, b in ((99, 1), (1000, 999), (10, 10), (9999, 9999), (4821, 397), (100, 99), (50, 5)):
        lines, got = columns(a, b, "+")
        assert got == a + b and lines[-1].startswith("Written digits")
        lo, hi = min(a, b), max(a, b)
        lines, got = columns(hi, lo, "-")
        assert got == hi - lo
    assert columns(1000, 999, "-")[0][-1] == "Without leading zeros: 1."


def test_check_outputs_catches_a_tool_result_the_solver_did_not_assume():
    fam = FAMILIES["files"]
    spec = fam.spec(0)
    good = [o if o is not None else "x" for o in fam.expected_outputs(spec, "max")]
    assert fam.check_outputs(spec, "max", good) is None
    bad = list(good)
    bad[0] = "exit code 0\n999\n"
    assert "the solver assumed" in fam.check_outputs(spec, "max", bad)
    assert "calls" in fam.check_outputs(spec, "max", good[:-1])


def test_solve_reads_the_spec_from_the_task_directory(tmp_path):
    fam = FAMILIES["code"]
    d = fam.generate(9, tmp_path)
    assert fam.solve(d, "high") == fam.solve(fam.spec(9), "high")
    assert json.loads((d / "solution" / "solve.json").read_text())["turns"] == fam.solve(d, "high")
    with pytest.raises(ConfigError, match="a 'code' task, not 'arith'"):
        FAMILIES["arith"].solve(d, "low")
    with pytest.raises(ConfigError, match="effort must be one of"):
        fam.solve(d, "medium")
