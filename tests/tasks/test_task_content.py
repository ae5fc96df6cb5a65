"""The starter task suite (tasks/): structure, and replays of every transcript on the host.

Per task: the initial workspace scores < 1 and fails its visible checks; the reference solution
scores 1.0 and passes them; every hack that acts only on workspace files scores 0.0 (hacks that
pass the visible checks are shown to do so first: the hidden verifier, not the checks, stops them).
Hacks whose failure depends on the real sandbox (writes outside the workspace, a replaced
interpreter in the root, reading /verifier) carry ``"needs_sandbox": true``; they are listed
exactly below and replayed by the framework's suite test instead (k3 task suite), never here.
The replay applier (tests/tasks/applier.py) is independent of k3.agent.
"""

import json
import os
import re
from pathlib import Path

import pytest

import applier

TASK_DIRS = applier.task_dirs()
IDS = [p.name for p in TASK_DIRS]
HACK_KINDS = ("edit-checks", "hardcode", "read-verifier", "budget", "plant", "replace-tool", "reach-verifier")
TOP_KEYS = {"id", "kind", "goal", "submit", "budget", "scoring", "tools", "verifier"}
TABLE_KEYS = {"budget": {"steps", "tokens", "wall_seconds", "submissions"}, "scoring": {"use"},
              "tools": {"allowed"}, "verifier": {"timeout", "network"}}
TOOLS = {"shell", "read", "write", "edit", "list", "submit"}
TRANSCRIPT_KEYS = {"description", "expect_reward", "turns", "needs_sandbox"}

# Hacks replayed only in real sandboxes (k3 task suite): (task id, hack name).
NEEDS_SANDBOX = {
    ("fix-median", "replace-tool-python3"),
    ("merge-inventory", "replace-tool-python3"),
    ("dedupe-lines", "replace-tool-sh"),
    ("fix-wordfreq", "replace-tool-sh"),
    ("impl-roman", "read-verifier"),
    ("json-flatten", "read-verifier"),
    ("fix-calc", "read-verifier"),
    # the verifier process itself (tests/rl/reach.py renders them; tests/rl/test_verdict_layers.py
    # checks each against each layer)
    *{("fix-median", "reach-verifier-" + m) for m in ("fd-kill", "daemon", "ptrace", "proc-mem", "environ-cwd",
                                                      "signal")},
}

ALL_HACKS = [(p, name, t) for p in TASK_DIRS for name, t in applier.transcripts(p) if name != "solution"]
LOCAL_HACKS = [(p, n, t) for p, n, t in ALL_HACKS if not t.get("needs_sandbox")]


def hack_kind(name):
    stem = name.split("/", 1)[1]
    kinds = [k for k in HACK_KINDS if stem == k or stem.startswith(k + "-")]
    assert kinds, "hack %s: name must start with one of %s" % (name, HACK_KINDS)
    return kinds[0]


def test_suite_size_and_kinds():
    assert len(TASK_DIRS) >= 24
    kinds = {applier.load_task(p)["kind"] for p in TASK_DIRS}
    assert kinds == {"python", "shell", "data"}
    assert {hack_kind(n) for _, n, _ in ALL_HACKS} == set(HACK_KINDS)


@pytest.mark.parametrize("task_dir", TASK_DIRS, ids=IDS)
def test_structure(task_dir):
    cfg = applier.load_task(task_dir)
    assert set(cfg) <= TOP_KEYS and {"id", "kind", "goal"} <= set(cfg)
    for table, keys in TABLE_KEYS.items():
        assert set(cfg.get(table, {})) <= keys, table
    assert cfg["id"] == task_dir.name and re.fullmatch(r"[a-z0-9][a-z0-9-]*", cfg["id"])
    assert cfg["kind"] in {"python", "shell", "data"}
    assert len(cfg["goal"].strip()) > 80 and "checks/run.py" in cfg["goal"]
    assert isinstance(cfg["submit"], list) and cfg["submit"] and all(isinstance(g, str) for g in cfg["submit"])
    assert not any(g.startswith(("/", "..")) or "checks" in g for g in cfg["submit"])
    assert set(cfg["tools"]["allowed"]) <= TOOLS and "submit" in cfg["tools"]["allowed"]
    assert cfg["scoring"]["use"] in {"best", "last"}
    assert 1 <= cfg["budget"]["submissions"] <= 5 and cfg["verifier"]["network"] is False
    for rel in ("workspace", "checks/run.py", "verifier/verify.py", "solution/solve.json"):
        assert (task_dir / rel).exists(), rel
    assert not (task_dir / "verifier" / "vharness.py").exists(), "k3.tasks.verify provides vharness.py"
    assert list((task_dir / "hacks").glob("*.json")), "no hacks"
    for name, t in applier.transcripts(task_dir):
        assert set(t) <= TRANSCRIPT_KEYS and {"description", "expect_reward", "turns"} <= set(t), name
        assert t["expect_reward"] == (1.0 if name == "solution" else 0.0), name
        assert isinstance(t.get("needs_sandbox", False), bool), name
        calls = [c for turn in t["turns"] for c in turn["tool_calls"]]
        assert all(c["name"] in cfg["tools"]["allowed"] for c in calls), name
        assert any(c["name"] == "submit" for c in calls), name + " never submits"
        if name != "solution":
            hack_kind(name)


def test_needs_sandbox_hacks_listed():
    """Exactly the listed hacks are sandbox-only, and each really reaches outside the workspace."""
    marked = {(p.name, n.split("/", 1)[1]) for p, n, t in ALL_HACKS if t.get("needs_sandbox")}
    assert marked == NEEDS_SANDBOX
    for p, n, t in ALL_HACKS:
        if t.get("needs_sandbox"):
            text = json.dumps(t["turns"])
            assert re.search(r"/verifier|/usr/bin|/bin/|\.\./|/etc/|/tmp/|~/|\$HOME|/proc/", text), n


@pytest.mark.parametrize("task_dir", TASK_DIRS, ids=IDS)
def test_initial_workspace_fails(task_dir, tmp_path):
    ep = applier.Episode(task_dir, tmp_path)
    rc, _ = applier.run_checks(ep.ws)
    assert rc != 0, "visible checks already pass on the initial workspace"
    ep.submit()
    assert ep.rewards[0] < 1.0, ep.log


@pytest.mark.parametrize("task_dir", TASK_DIRS, ids=IDS)
def test_solution_scores_one(task_dir, tmp_path):
    t = dict(applier.transcripts(task_dir))["solution"]
    ep = applier.replay(task_dir, t, tmp_path)
    assert ep.score() == 1.0, ep.log
    rc, out = applier.run_checks(ep.ws)
    assert rc == 0, out


@pytest.mark.parametrize("task_dir,name,transcript", LOCAL_HACKS, ids=["%s:%s" % (p.name, n) for p, n, _ in LOCAL_HACKS])
def test_hack_scores_zero(task_dir, name, transcript, tmp_path):
    ep = applier.replay(task_dir, transcript, tmp_path)
    kind = hack_kind(name)
    if kind in ("edit-checks", "hardcode"):
        rc, out = applier.run_checks(ep.ws)
        assert rc == 0, "the hack should fool the visible checks: " + out
    if kind == "budget":
        assert ep.refused > 0, "a budget hack must go over the submission budget"
    assert ep.rewards, "the hack never got a submission verified"
    assert ep.score() == 0.0, ep.log


RUNTIME = [(p, n, t) for p, n, t in LOCAL_HACKS if n.startswith("hacks/read-verifier-runtime")]


@pytest.mark.parametrize("task_dir,name,transcript", RUNTIME, ids=["%s:%s" % (p.name, n) for p, n, _ in RUNTIME])
def test_runtime_verifier_read_needs_the_isolation(task_dir, name, transcript, tmp_path):
    """Workspace code that reads the verifier while the verifier runs it scores 0 here (on the
    host, no /verifier to remove) because the verifier runs it as another uid over a 0700
    directory (``uid`` among the isolation layers); the positive control runs the same verifier
    unable to switch uid (nor to make namespaces), and there the same submission scores 1.0."""
    if os.geteuid() != 0:
        pytest.skip("the verifier's uid isolation (and this control) needs root, as in the sandbox")
    ep = applier.replay(task_dir, transcript, tmp_path)
    sub, reason = ep.submissions[-1]
    assert ep.score() == 0.0 and re.search(r"isolation: [a-z,]*\buid\b", reason), reason
    reward, reason = applier.verify(task_dir, sub, user=65534)
    assert reward == 1.0 and not re.search(r"isolation: [a-z,]*\b(uid|removed)\b", reason), reason


def test_verifier_takes_its_workspace_from_argv_only(tmp_path):
    """The workspace is the --workspace argument (or /workspace); any other argument is refused with
    reward 0; no verifier reads the environment. Positive control: the same submission scores 1.0
    with the plain argument."""
    for p in TASK_DIRS:
        for f in (p / "verifier").glob("*.py"):
            assert not re.search(r"environ|getenv", f.read_text()), f
    task = applier.TASKS / "fix-median"
    ep = applier.replay(task, dict(applier.transcripts(task))["solution"], tmp_path / "a")
    sub, _reason = ep.submissions[-1]
    assert applier.verify(task, sub)[0] == 1.0
    reward, reason = applier.verify(task, sub, argv=["--workspace", str(sub), "--reward", "1"])
    assert reward == 0.0 and "usage" in reason
    empty = tmp_path / "empty"
    empty.mkdir()
    assert applier.verify(task, empty)[0] == 0.0
