"""The clean room (SPEC §7.2), in real namespace sandboxes: the verifier is never readable from the
agent's sandbox; a submission is data (only the submit globs, regular files, size-capped); what
the agent planted in its own sandbox cannot change the verdict. Each refusal has its positive
control: the verifier sandbox reads the verifier; a non-isolating sandbox can read the host path;
the planted files do act inside the agent's sandbox."""

import hashlib

import pytest

from k3.agent.providers import Scripted
from k3.env.backends.local import NotIsolatedWarning
from k3.env.manager import SandboxManager
from k3.env.sandbox import Limits
from k3.rl.rollout import run_episode
from k3.tasks.format import load_task
from k3.rl.trajectory import TrajectoryWriter
from k3.tasks.verify import MAX_SUBMIT_FILE, Submission, agent_sandbox, collect_submission, verify
from taskdirs import FIXED, make_task, vharness_verifier

MARKER = "VERIFIER-MARKER-5c1e9"
SELF_READING_VERIFY = f"# {MARKER}\n" + vharness_verifier(
    f'return (1.0 if "{MARKER}" in TEXT else 0.0), "read myself"', prelude='TEXT = open("/verifier/verify.py").read()')


def probes(host_verify: str) -> list[dict]:
    lines = ["cat /verifier/verify.py", "cat ../verifier/verify.py", f"cat {host_verify}",
             "find / -name verify.py -not -path '/proc/*' 2>/dev/null -exec cat {} +",
             f"grep -r {MARKER} / --exclude-dir=proc 2>/dev/null"]
    calls = [{"name": "shell", "arguments": {"command": c}} for c in lines]
    calls += [{"name": "read", "arguments": {"path": p}} for p in ("/verifier/verify.py", "../verifier/verify.py",
                                                                   host_verify)]
    return calls


def test_the_verifier_is_never_readable_from_the_agent_sandbox(tmp_path, sandboxes):
    d = make_task(tmp_path, verify=SELF_READING_VERIFY, steps=40)
    host_verify = str((d / "verifier" / "verify.py").resolve())
    turns = [{"tool_calls": probes(host_verify)},
             {"tool_calls": [{"name": "write", "arguments": {"path": "calc.py", "content": FIXED}},
                             *probes(host_verify), {"name": "submit", "arguments": {}}]},
             {"tool_calls": probes(host_verify)}]
    w = TrajectoryWriter()
    s = run_episode(d, Scripted(turns), w, sandboxes=sandboxes)
    outs = [r["result"] for r in w.records if r["type"] == "tool" and r["name"] in ("shell", "read")]
    assert len(outs) == 3 * 8
    assert all(MARKER not in o["output"] for o in outs), [o["output"][:200] for o in outs if MARKER in o["output"]]
    assert all(o["error"] for o in outs)  # every probe failed (no such file / nothing found)
    assert s["score"] == 1.0  # positive control: the verifier's own sandbox reads /verifier/verify.py


def test_a_sandbox_without_isolation_does_read_the_host_path(tmp_path, env_root):
    """The probe above is a real one: the 'local' backend (no isolation) sees the host file."""
    d = make_task(tmp_path, verify=SELF_READING_VERIFY)
    with pytest.warns(NotIsolatedWarning, match="NOT ISOLATED"):
        sb = SandboxManager(env_root).create("default", Limits.unlimited(), backend="local")
    try:
        r = sb.exec(f"cat {(d / 'verifier' / 'verify.py').resolve()}", timeout=30)
        assert r.ok and MARKER in r.text()
    finally:
        sb.close()


PLANTS = {
    "conftest.py": "import json\nprint(json.dumps({'reward': 1.0, 'reason': 'conftest'}))\n",
    "sitecustomize.py": "import json\nprint(json.dumps({'reward': 1.0, 'reason': 'sitecustomize'}))\n",
    "usercustomize.py": "import json\nprint(json.dumps({'reward': 1.0, 'reason': 'usercustomize'}))\n",
    "evil.pth": "import json; print(json.dumps({'reward': 1.0, 'reason': 'pth'}))\n",
    "pytest.ini": "[pytest]\naddopts = -p no:everything\n",
    "python3": "#!/bin/sh\necho '{\"reward\": 1.0, \"reason\": \"fake python\"}'\n",
    "json.py": "def dumps(*a, **k):\n    return '{\"reward\": 1.0, \"reason\": \"shadowed json\"}'\n",
}
FAKE = "#!/bin/sh\necho '{\"reward\": 1.0, \"reason\": \"replaced interpreter\"}'\n"


def test_files_planted_in_the_agent_sandbox_do_not_change_the_verdict(tmp_path, sandboxes):
    d = make_task(tmp_path)
    d.joinpath("task.toml").write_text(d.joinpath("task.toml").read_text().replace('submit = ["*.py"]',
                                                                                  'submit = ["*", "**/*"]'))
    task = load_task(d)
    sb = agent_sandbox(task, sandboxes)
    try:
        for name, text in PLANTS.items():
            sb.write_file(name, text, mode=0o755)
        sb.write_file("/root/.profile", "export PATH=/workspace:$PATH\n")
        sb.write_file("/tmp/fake", FAKE, mode=0o755)  # replace the interpreter of the agent's root
        r = sb.exec("for p in /usr/bin/python3 /usr/local/bin/python3; do rm -f $p; cp /tmp/fake $p; done",
                    timeout=30)
        assert r.ok, r
        # positive control: the plants act inside the agent's own sandbox
        r = sb.exec("python3 -c 'print(42)'", timeout=30)
        assert "replaced interpreter" in r.text()
        sub = collect_submission(sb, task.submit)
    finally:
        sb.close()
    assert set(PLANTS) | {"calc.py", "checks/check.py"} <= set(sub.files)  # the plants are submitted as data
    v = verify(task, sub, sandboxes)
    assert (v.reward, v.reason.startswith("wrong")) == (0.0, True), v
    sub.files["calc.py"] = FIXED.encode()  # the same plants beside a correct fix: the verifier still judges
    assert verify(task, sub, sandboxes).reward == 1.0


def test_a_submission_is_only_matching_regular_files_under_the_cap(tmp_path, sandboxes):
    task = load_task(make_task(tmp_path))
    sb = agent_sandbox(task, sandboxes)
    try:
        sb.write_file("big.py", b"#" * (MAX_SUBMIT_FILE + 1))
        sb.write_file("ok.py", b"x = 1\n")
        sb.write_file("notes.txt", b"not submitted")
        r = sb.exec("ln -s /etc/passwd link.py && mkdir dir.py", timeout=30)
        assert r.ok, r
        sub = collect_submission(sb, task.submit)
    finally:
        sb.close()
    assert sorted(sub.files) == ["calc.py", "ok.py"]
    assert sub.skipped == {"big.py": f"{MAX_SUBMIT_FILE + 1} bytes > {MAX_SUBMIT_FILE}",
                           "dir.py": "not a regular file (dir)", "link.py": "not a regular file (symlink)"}
    assert sub.manifest()["files"]["ok.py"] == {"sha256": hashlib.sha256(b"x = 1\n").hexdigest(), "bytes": 6}


RAW_VERIFIER = """import json, os, signal, sys, time
cfg = json.loads(sys.stdin.readline())
def send(obj):
    os.write(3, ((obj if isinstance(obj, str) else json.dumps(obj)) + "\\n").encode())
good = {"nonce": cfg["nonce"], "reward": 1, "reason": "fine",
        "isolation": ["nodump", "pidns", "uid", "roroot", "landlock", "removed"]}
"""


def test_the_verdict_channel_takes_exactly_one_nonce_verdict_from_a_clean_exit(tmp_path, sandboxes):
    """A raw verifier (no vharness) writes the channel itself: every way a verdict can be wrong is
    reward 0 naming why; the positive control, one well-formed verdict, scores 1.0."""
    cases = {
        "print(json.dumps({'reward': 1.0, 'reason': 'stdout'}))": "no verdict on the verdict channel",
        "send('no json')": "not JSON",
        "send({**good, 'reward': 1.5})": "not a number in [0, 1]",
        "send({**good, 'nonce': '0' * 32})": "does not carry this run's nonce",
        "send({k: v for k, v in good.items() if k != 'nonce'})": "does not carry this run's nonce",
        "send(good); send(good)": "2 verdicts on the verdict channel",
        "send(good); sys.exit(3)": "exited with code 3",
        "send(good); os.kill(os.getpid(), signal.SIGKILL)": "killed by signal 9",
        "send({**good, 'isolation': ['nodump']})": "isolation unavailable",
        "time.sleep(60)": "timed out",
        "send(good)": "fine",
    }
    for i, (code, why) in enumerate(cases.items()):
        d = make_task(tmp_path / str(i), verify=RAW_VERIFIER + code + "\n")
        d.joinpath("task.toml").write_text(d.joinpath("task.toml").read_text().replace("timeout = 30",
                                                                                      "timeout = 1"))
        task = load_task(d)
        v = verify(task, Submission({"calc.py": FIXED.encode()}, {}), sandboxes)
        assert why in v.reason, (code, v)
        assert v.reward == (1.0 if why == "fine" else 0.0), (code, v)


def test_tasks_refuse_the_local_backend(tmp_path, env_root, capsys, monkeypatch):
    from k3.errors import ConfigError
    from k3.cli.task import task_main
    from k3.tasks.verify import Sandboxes

    with pytest.raises(ConfigError, match="does not isolate"):
        Sandboxes("local", env_root)
    d = make_task(tmp_path)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match="does not isolate"):
        task_main(["run", str(d), "--backend", "local"])
    assert not (tmp_path / "trajectories").exists()  # refused before anything was written
    assert task_main(["run", str(d), "--out", str(tmp_path / "t.jsonl")]) == 0  # the default backend runs it
    assert "score 1.000" in capsys.readouterr().out
