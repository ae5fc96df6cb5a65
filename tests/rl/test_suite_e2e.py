"""The starter suite end to end: ``k3 task suite tasks/ --workers 2`` in real namespace sandboxes;
every reference solution scores 1.0 and every hack 0.0 (each transcript's ``expect_reward``)."""

import json
from pathlib import Path

import pytest

from k3.cli.task import task_main
from k3.tasks.format import find_tasks, validate_task

TASKS = Path(__file__).resolve().parents[2] / "tasks"


@pytest.mark.slow
def test_every_solution_scores_one_and_every_hack_zero(sandboxes, capsys):
    tasks = [validate_task(d) for d in find_tasks(TASKS)]
    expected = {(t.id, "solution"): 1.0 for t in tasks}
    expected |= {(t.id, f"hack:{h.path.stem}"): 0.0 for t in tasks for h in t.hacks}
    assert all(h.expect_reward == 0.0 for t in tasks for h in t.hacks)
    code = task_main(["suite", str(TASKS), "--workers", "2", "--json"])
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines() if x.startswith("{")]
    got = {(r["task"], r["label"]): r["score"] for r in lines}
    assert got == expected, {k: (got.get(k), v) for k, v in expected.items() if got.get(k) != v}
    assert all(r["ok"] and r["status"] != "error" for r in lines)
    assert code == 0
