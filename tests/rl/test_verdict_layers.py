"""The verdict's threat model (SPEC §7.2), layer by layer, in real namespace sandboxes.

Each hack is workspace code that attacks the verifier *process* from inside a verifier's child
(tests/rl/reach.py; the fix-median ones are also task hacks that `k3 task suite` replays). For
each: with every layer on it scores 0 and its move never lands; with every layer off (the
positive control: a plain sandbox, no channel, the verdict as the last stdout line) the same
submission wins (or, for the signal, kills the verifier) — so the hack is real; and for each
layer named beside it, that layer alone (every other one off) stops it, so the layer is
load-bearing. ``pidns``, ``uid`` and ``roroot`` need the nested sandbox's capabilities, so their
"alone" runs keep ``caps`` on, and are listed only where ``caps`` alone does not stop the hack.
"""

import json
import sys
from pathlib import Path

import pytest

from k3.agent.providers import Scripted
from k3.rl.rollout import run_episode
from k3.tasks.format import load_task
from k3.rl.trajectory import TrajectoryWriter
from k3.tasks.verify import CONTROL_LAYERS, NEEDS_CAPS, Submission, verify
from taskdirs import BROKEN, FIXED, make_task, vharness_verifier

sys.path.insert(0, str(Path(__file__).resolve().parent))
import reach  # noqa: E402

ALL_OFF = tuple(CONTROL_LAYERS)


def only(layer):
    """layers_off that leave ``layer`` alone on (with ``caps`` where it needs them); ``all``:
    every layer on; ``none``: every layer off."""
    if layer in ("all", "none"):
        return () if layer == "all" else ALL_OFF
    keep = {layer, "caps"} if layer in NEEDS_CAPS else {layer}
    return tuple(x for x in CONTROL_LAYERS if x not in keep)


FD_FAMILY = ("channel", "caps", "nodump", "landlock")
STOPPED_BY = {"fd-kill": FD_FAMILY, "daemon": FD_FAMILY, "ptrace": FD_FAMILY, "proc-mem": FD_FAMILY,
              "environ-cwd": FD_FAMILY, "signal": ("pidns", "uid", "landlock")}
CASES = [(m, layer) for m in reach.MOVES for layer in ("all",) + STOPPED_BY[m] + ("none",)]


def median_submission(move):
    ws = reach.TASK / "workspace"
    files = {p.relative_to(ws).as_posix(): p.read_bytes() for p in (ws / "stats").glob("*.py")}
    files[reach.TARGET] = reach.submission_code(move, files[reach.TARGET].decode()).encode()
    return Submission(files, {})


def landed(move, v):
    return ("killed by signal 9" in v.reason or "exit code 137" in v.reason) if move == "signal" \
        else "forged by the submission" in v.reason


@pytest.mark.parametrize("move,layer", CASES, ids=[f"{m}:{layer}" for m, layer in CASES])
def test_each_layer_alone_stops_the_move_and_the_control_lets_it_land(move, layer, sandboxes):
    task = load_task(reach.TASK)
    off = only(layer)
    v = verify(task, median_submission(move), sandboxes, layers_off=off)
    if layer == "none":  # the positive control: this move does reach the verifier
        assert landed(move, v), v
        assert v.reward == (0.0 if move == "signal" else 1.0), v
    else:
        assert v.reward == 0.0 and not landed(move, v), v
        # the verifier ran to its own verdict on the buggy package, or (channel alone) was killed and refused
        assert "median(" in v.reason or layer == "channel", v


def test_the_task_hacks_are_rendered_from_the_moves():
    for m in reach.MOVES:
        assert json.loads(reach.path(m).read_text()) == reach.render(m), f"python {Path(reach.__file__).name}"


def verify_tiny(tmp_path, sandboxes, verifier, calc, layer):
    """(task, layers_off, verdict) of submitting ``calc`` as calc.py to a tiny task with ``verifier``,
    with only ``layer`` on (``only``)."""
    task, off = load_task(make_task(tmp_path, verify=verifier)), only(layer)
    return task, off, verify(task, Submission({"calc.py": calc.encode()}, {}), sandboxes, layers_off=off)


# --- a replaced interpreter: the first child replaces /usr/bin/python3, the verifier's next launch runs it
TWO_RUNS = vharness_verifier('''
code = "import sys; sys.path.insert(0, '.'); import calc; print(calc.add(%s))"
a = ctx.python(code % "1234, -34", ctx.fresh(), timeout=20)
b = ctx.python(code % "0.5, 0.25", ctx.fresh(), timeout=20)
ok = [a.stdout.split(), b.stdout.split()] == [["1200"], ["0.75"]]
return (1.0, "add correct") if ok else (0.0, "add wrong: %r %r" % (a.stdout + a.stderr, b.stdout + b.stderr))
''')
INTERPRETER = BROKEN + reach.COMMON + r'''
_real = _os.path.realpath("/usr/bin/python3")
try:
    with open("/usr/bin/.k3-move.py", "w") as _f:
        _f.write(open(__file__).read().split("# --- launcher ---")[1])
    with open("/usr/bin/.python3.new", "w") as _f:
        _f.write('#!/bin/sh\n%s -I -S /usr/bin/.k3-move.py\nexec %s "$@"\n' % (_real, _real))
    _os.chmod("/usr/bin/.python3.new", 0o755)
    _os.replace("/usr/bin/.python3.new", "/usr/bin/python3")
except OSError:
    pass
# --- launcher ---
''' + reach.COMMON + "\nfor _v in _k3_verifiers():\n    _k3_win(_v)\n"


@pytest.mark.parametrize("layer", ["all", "roroot", "uid", "nodump", "channel", "none"])
def test_a_replaced_interpreter_never_runs_as_a_later_launcher(layer, tmp_path, sandboxes):
    """The launcher of each child is the verifier's own interpreter, started before the child's
    layers: a first child that replaced it would run unisolated as the second launcher.
    ``roroot`` and ``uid`` each keep it from writing the root; ``nodump`` and ``channel`` each
    keep the fake launcher from deciding the verdict."""
    task, off, v = verify_tiny(tmp_path, sandboxes, TWO_RUNS, INTERPRETER, layer)
    if layer == "none":
        assert v.reward == 1.0 and "forged by the submission" in v.reason, v
    else:
        assert v.reward == 0.0 and "forged" not in v.reason, v
    honest = verify(task, Submission({"calc.py": FIXED.encode()}, {}), sandboxes, layers_off=off)
    assert honest.reward == 1.0, honest  # the same verifier under the same layers passes a real fix


# --- a child that outlives its run and rewrites the verifier's reference child's result
REFERENCE_AFTER = vharness_verifier('''
got = ctx.results("import calc\\nemit([calc.add(a, b) for a, b in payload])", ctx.fresh(), [[1234, -34], [1, 2]])
want = ctx.results("# K3-REFERENCE\\nemit([a + b for a, b in payload])", ctx.fresh(), [[1234, -34], [1, 2]])
return (1.0, "matches the reference") if got == want else (0.0, "got %r, want %r" % (got, want))
''')
TAMPER = BROKEN + reach.COMMON + r'''
import json as _json
if _os.fork() == 0:
    _os.setsid()
    if _os.fork() == 0:
        for _fd in range(0, 1024):
            try:
                _os.close(_fd)
            except OSError:
                pass
        _end, _w, _ref = _time.monotonic() + 30, None, None
        while _w is None and _time.monotonic() < _end:
            for _p in [p for p in _os.listdir("/proc") if p.isdigit()]:
                try:
                    if b"K3-REFERENCE" in open("/proc/%s/cmdline" % _p, "rb").read():
                        _ref, _w = _p, _os.open("/proc/%s/fd/1" % _p, _os.O_WRONLY)
                        break
                except OSError:
                    pass
            _time.sleep(0.001)
        def _running(p):  # until it exits (a zombie waits for a parent that waits for our write end)
            try:
                return open("/proc/%s/stat" % p).read().rsplit(")", 1)[1].split()[0] not in "ZX"
            except OSError:
                return False
        while _w is not None and _running(_ref) and _time.monotonic() < _end:
            _time.sleep(0.001)
        if _w is not None:
            _os.write(_w, ("\n@@K3-VERIFY-RESULT@@" + _json.dumps([add(1234, -34), add(1, 2)]) + "\n").encode())
    _os._exit(0)
'''


@pytest.mark.parametrize("layer", ["all", "pidns", "landlock", "none"])
def test_no_child_outlives_its_run_to_tamper_with_a_later_child(layer, tmp_path, sandboxes):
    """``pidns`` kills what a child left when its run ends (and hides the later child); Landlock
    puts each child in its own domain, so a survivor cannot open a sibling's descriptors."""
    _task, _off, v = verify_tiny(tmp_path, sandboxes, REFERENCE_AFTER, TAMPER, layer)
    if layer == "none":
        assert v.reward == 1.0 and "matches the reference" in v.reason, v
    else:
        assert v.reward == 0.0 and "got [1268, -1], want [1200, 3]" in v.reason, v


# --- the agent's sandbox: nothing the agent runs reaches the harness, its trajectory or the verification
def test_the_agent_sandbox_reaches_neither_the_harness_nor_the_trajectory_nor_the_verification(tmp_path,
                                                                                             sandboxes):
    d = make_task(tmp_path / "t")
    traj = tmp_path / "traj.jsonl"
    shell = [
        # the positive control: a signal inside the sandbox does land
        "sleep 30 & p=$!; kill -9 $p; wait $p; echo killed:$?",
        "cat /proc/[0-9]*/cmdline | tr '\\0' ' '",
        f"echo forged >> {traj}; ls {tmp_path}",
        "setsid sh -c 'sleep 60' >/dev/null 2>&1 < /dev/null & echo started",
        "kill -9 -1; echo after-kill",  # everything of the sandbox, its exec agent included
    ]
    turns = [{"tool_calls": [{"name": "write", "arguments": {"path": "calc.py", "content": FIXED}},
                             {"name": "submit", "arguments": {}}]},
             {"tool_calls": [{"name": "shell", "arguments": {"command": c}} for c in shell]}]
    w = TrajectoryWriter(traj)
    s = run_episode(d, Scripted(turns), w, sandboxes=sandboxes, yolo=True)  # the sandbox, not the policy, is the wall
    outs = [r["result"]["output"] for r in w.records if r["type"] == "tool" and r["name"] == "shell"]
    assert "killed:137" in outs[0]
    assert "pytest" not in outs[1] and "verify" not in outs[1] and "agent.py" in outs[1], outs[1]
    assert "No such file" in outs[2] and "forged" not in traj.read_text().splitlines()
    assert s["score"] == 1.0, s  # the verification that followed is the honest one
    lines = traj.read_text().splitlines()
    assert all(json.loads(x) for x in lines) and len(lines) == len(w.records)
