"""benchmarks/distill_demo.py: its task pattern covers the nine (family, effort) cells at every step
of both arms' slot rules, its targets are computed as the issue states them (hand-written cells), and
end to end at nano size it writes teachers per tag, the three arms, every model's held-out cells,
the report, the results lines and the docs table. The nano run evaluates 0 held-out tasks per cell:
those episodes are the agent demo's ``evaluate_heldout``, run with tasks in tests/rl/test_agent_demo.py
(with one task per cell here the test took 150-220 s instead of 60)."""

from __future__ import annotations

import importlib.util
import itertools
import json
import subprocess
import sys
from pathlib import Path

import pytest

from k3.errors import ConfigError
from k3.tasks.families import CELL_PATTERN, EFFORTS, cell_order, cell_pattern, cell_task_list, get_family

ROOT = Path(__file__).resolve().parents[2]
FAMS = ("arith", "files", "code")


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "benchmarks" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


D = _load("distill_demo")


def test_the_pattern_puts_every_cell_in_each_step_of_both_arms():
    """A step of ``tasks_per_step`` k takes positions k·s .. k·s+k-1 of the list, and position p has
    effort p mod 3 (``k3.rl.grpo``'s cycling): with the pattern every run of 9 positions holds all
    nine cells, and the RL arm's three steps of 3 cover them too. The control: plain interleaving
    (arith, files, code, ...) pairs each family with one effort only."""
    cells = set(itertools.product(FAMS, EFFORTS))
    made = {f: [f"{f}{i}" for i in range(6)] for f in FAMS}
    order = cell_task_list(made, 2)
    got = [(f, EFFORTS[p % 3]) for p, (f, _) in enumerate(order)]
    assert set(got[:9]) == set(got[9:]) == cells and len(set(got[:9])) == 9
    assert set(cell_order()) == cells
    assert [t for _, t in order[:3]] == ["arith0", "files0", "code0"] and order[5] == ("arith", "arith1")
    plain = [(f, EFFORTS[p % 3]) for p, f in enumerate(FAMS * 3)]
    assert len(set(plain)) == 3
    with pytest.raises(ConfigError, match="code: 5 tasks, 6 needed"):   # 2 blocks take 6 of each family
        cell_task_list({**made, "code": made["code"][:5]}, 2)


@pytest.mark.parametrize("fams", [("arith",), ("files", "code"), ("code", "arith"), FAMS])
def test_the_pattern_of_some_families_holds_each_of_their_cells(fams):
    """``cell_pattern(families)``: 9 positions of those families only, position p at effort p mod
    3; every cell of theirs is in it, equally often for 1 or 3 families (counted here by
    enumeration), and a list of all three gives the demo's own pattern. The control: unknown,
    repeated or no families are refused."""
    pat = cell_pattern(fams)
    assert len(pat) == 9 and set(pat) == set(fams)
    count = {c: 0 for c in itertools.product(fams, EFFORTS)}
    for p, f in enumerate(pat):
        count[(f, EFFORTS[p % 3])] += 1
    assert min(count.values()) >= 1
    if len(fams) != 2:
        assert set(count.values()) == {3 // len(fams)}
    if len(fams) == 3:
        assert pat == CELL_PATTERN
    for bad in (["arith", "maths"], ["arith", "arith"], []):
        with pytest.raises(ConfigError, match="families must be distinct names"):
            cell_pattern(bad)


def test_targets_follow_the_issue_on_hand_written_cells():
    def cell(model, fam, eff, rate, reasoning=0.0):
        return {"model": model, "family": fam, "effort": eff, "pass_rate": rate, "reasoning_chars": reasoning}

    names = [f"{f}/{e}" for f in ("a", "b") for e in ("low", "high", "max")]
    teachers = {"t1": "a/low", "t2": "b/max"}
    rates = {"t1": [0.8, 0, 0, 0, 0, 0], "t2": [0, 0, 0, 0, 0, 0.5],
             "distill": [0.72, 0.1, 0.1, 0.1, 0.1, 0.44], "init": [0] * 6, "sft": [0.1] * 6, "rl": [0.2] * 6}
    reasoning = {"low": 5.0, "high": 20.0, "max": 40.0}
    cells = [cell(m, *k.split("/"), r, reasoning[k.split("/")[1]]) for m, rs in rates.items()
             for k, r in zip(names, rs)]
    tg = D.targets(cells, teachers)
    # 0.72 >= 0.9 * 0.8 = 0.72 (within), 0.44 < 0.9 * 0.5 = 0.45 (not): the relative 10 %
    assert tg["own_cell"]["t1"]["within_10pct"] and not tg["own_cell"]["t2"]["within_10pct"]
    assert not tg["all_within_10pct"]
    assert tg["mean_over_cells"]["distill"] == pytest.approx((0.72 + 0.4 + 0.44) / 6)
    assert tg["above_every_teacher"] and tg["reasoning_ordered"]
    assert tg["ahead_of_baselines"]   # 0.26 > 0.1 and > 0.2
    rates["rl"] = [0.3] * 6   # the control: a baseline ahead of the student
    cells = [cell(m, *k.split("/"), r, 1.0) for m, rs in rates.items() for k, r in zip(names, rs)]
    tg = D.targets(cells, teachers)
    assert not tg["ahead_of_baselines"] and not tg["reasoning_ordered"]


@pytest.mark.parametrize("seeds", ["arith", "arith:2,files:2", "arith:2,files:2,code:0", "arith:x,files:1,code:1"])
def test_bad_seeds_are_one_line_before_anything_runs(tmp_path, seeds):
    """(The nano run below, with all three families, is the control.)"""
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "distill_demo.py"), "--seeds", seeds,
                        "--out", str(tmp_path / "run"), "--base", str(tmp_path / "none")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "--seeds" in r.stderr
    assert not (tmp_path / "run").exists() and not (tmp_path / "none").exists()


@pytest.mark.parametrize("seeds,refused", [("arith:3,files:3", True), ("arith:3,files:2,code:3", True),
                                           ("arith:x,files:3,code:3", True), ("arith:3,files:3,code:3", False)])
def test_the_rl_demo_refuses_bad_seeds_before_its_evaluation(tmp_path, seeds, refused):
    """The RL demo checks --seeds before anything runs; the control (valid seeds) passes that check
    and is refused next for its missing SFT checkpoint."""
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "rl_demo.py"), "--seeds", seeds,
                        "--out", str(tmp_path / "run"), "--sft", str(tmp_path / "none")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert ("--seeds" in r.stderr) == refused and ("holds no checkpoint" in r.stderr) != refused, r.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("flag,value", [("--general-steps", "0"), ("--teacher-batch", "-1"), ("--heldout", "-1"),
                                        ("--rl-lr", "0"), ("--lr", "nan"), ("--families", "arith,maths"),
                                        ("--families", "code,code"), ("--init", "no-such-run"),
                                        ("--forward-weight", "1.5")])
def test_bad_sizes_and_rates_are_one_line_before_anything_runs(tmp_path, flag, value):
    """(The nano run below, with each of these at a valid value, is the control.)"""
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "distill_demo.py"), flag, value,
                        "--out", str(tmp_path / "run"), "--base", str(tmp_path / "none")],
                       capture_output=True, text=True, timeout=120)
    named = flag if flag != "--families" else "families must be"
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and named in r.stderr, r.stderr
    assert not (tmp_path / "run").exists() and not (tmp_path / "none").exists()


@pytest.mark.slow
def test_the_distill_demo_at_nano_size(tmp_path, make_nano_checkpoint, env_root):
    text = " ".join(json.dumps(get_family(f).solve(get_family(f).spec(s), "max")) for f in FAMS for s in range(2))
    base, _, _ = make_nano_checkpoint(tmp_path / "base", text)
    out = tmp_path / "run"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "distill_demo.py"), "--out", str(out), "--base", str(base),
           "--seeds", "arith:2,files:2,code:2", "--teacher-steps", "1", "--teacher-batch", "1",
           "--general-steps", "1", "--general-batch", "1", "--steps", "1", "--max-tokens", "6", "--heldout", "0",
           "--threads", "1", "--results", str(tmp_path / "results.jsonl")]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    tags = {f"{get_family(f).domain}/{e}" for f in FAMS for e in EFFORTS}
    assert {t["tag"] for t in report["teachers"].values()} == tags
    toml = (out / "teachers.toml").read_text()
    assert all(f'["{t}"]' in toml for t in tags)
    models = set(report["teachers"]) | {"init", "distill", "sft", "rl"}
    assert {c["model"] for c in report["cells"]} == models and len(report["cells"]) == 13 * 9
    assert {c["tasks"] for c in report["cells"]} == {0}
    # the distill arm's one step scored a row of every tag: each cell reached its own teacher
    assert set(report["curves"]["distill"][0]["kl_by_tag"]) == tags
    assert len(list((out / "teacher-samples").glob("*.jsonl"))) == 9
    assert report["compute"]["distill"]["steps"] == report["compute"]["rl"]["steps"] == 1
    assert report["machine"] and report["date"]
    lines = [json.loads(x) for x in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert len(lines) == 13 * 9 and {x["bench"] for x in lines} == {"distill_demo"}
    table = _load("docs_tables").distill_demo_table(report)
    assert report["date"] in table and "| teacher general/low |" in table
    assert table.count("**") >= 2 * 9   # each teacher's own cell in bold


@pytest.mark.slow
def test_the_distill_demo_on_one_family_from_a_given_init(tmp_path, make_nano_checkpoint, env_root):
    """``--families arith --init CKPT``: no base is pretrained and no generalist fine-tuned; the
    three arith teachers start from CKPT, every step of the distill arm reaches each of them, and
    the evaluation, targets and table cover the three arith cells only."""
    text = " ".join(json.dumps(get_family("arith").solve(get_family("arith").spec(s), "max")) for s in range(2))
    init, _, _ = make_nano_checkpoint(tmp_path / "init", text)
    out = tmp_path / "run"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "distill_demo.py"), "--out", str(out),
           "--base", str(tmp_path / "no-base"), "--init", str(init), "--families", "arith",
           "--seeds", "arith:2,files:2,code:2", "--teacher-steps", "1", "--teacher-batch", "1", "--steps", "1",
           "--max-tokens", "6", "--heldout", "0", "--threads", "1", "--results", str(tmp_path / "results.jsonl"),
           "--forward-weight", "0.5"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert not (tmp_path / "no-base").exists() and not (out / "student-init").exists()
    report = json.loads((out / "report.json").read_text())
    tags = {f"general/{e}" for e in EFFORTS}
    assert {t["tag"] for t in report["teachers"].values()} == tags
    assert sorted(p.name for p in (out / "data").iterdir()) == [f"arith-{e}.jsonl" for e in sorted(EFFORTS)]
    assert {c["family"] for c in report["cells"]} == {"arith"} and len(report["cells"]) == 7 * 3
    assert set(report["curves"]["distill"][0]["kl_by_tag"]) == tags
    assert len(list((out / "teacher-samples").glob("*.jsonl"))) == 9
    assert report["options"]["init"] == str(init) and report["options"]["families"] == ["arith"]
    assert report["options"]["forward_weight"] == 0.5
    from k3.checkpoint.training import find_checkpoint, load_trainer_state
    assert load_trainer_state(find_checkpoint(str(out / "distill")))["data"]["distill"]["forward_weight"] == 0.5
    assert "init_s" not in report["times"]
    table = _load("docs_tables").distill_demo_table(report)
    assert f"Student init: `{init}`" in table and "over the three cells" in table
    assert "exact KL, 0.5 × reverse + 0.5 × forward" in table
    assert "| teacher general/high |" in table and "files/" not in table
