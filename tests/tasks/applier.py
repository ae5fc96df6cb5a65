"""A test-local replay of Scripted transcripts on a task, independent of k3.agent / k3.rl.

It copies a task's ``workspace/`` and ``checks/`` (as ``checks/``) into a temporary directory,
applies the transcript's write/edit/read/list calls there, runs its shell calls with ``/bin/sh -c``
(cwd = the copy, PATH=/usr/bin:/bin, a timeout), and on each ``submit`` collects the files the
task's ``submit`` globs match (regular files <= 1 MiB, no symlinks) into a fresh directory and runs
a temporary copy of ``verifier/verify.py`` on it (``python3 -I -S verify.py --workspace DIR``).
Submissions beyond ``budget.submissions`` are refused; the score is the best or last accepted one.
No isolation: transcripts marked ``needs_sandbox`` must not be replayed here.
"""

import json
import os
import shutil
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

from k3.tasks.verify import VHARNESS

TASKS = Path(__file__).resolve().parents[2] / "tasks"
PY = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else sys.executable
ENV_PATH = "/usr/bin:/bin"
MAX_FILE = 1 << 20


def load_task(task_dir):
    with open(Path(task_dir) / "task.toml", "rb") as f:
        return tomllib.load(f)


def task_dirs():
    return sorted(p for p in TASKS.iterdir() if (p / "task.toml").is_file())


def _inside(root, rel):
    path = (Path(root) / rel).resolve()
    if Path(rel).is_absolute() or not path.is_relative_to(Path(root).resolve()):
        raise ValueError("path outside the workspace: %s" % rel)
    return path


def collect(ws, globs, dst):
    """Copy the files of ``ws`` matching ``globs`` into ``dst``; returns their relative paths."""
    ws = Path(ws)
    seen = set()
    for pattern in globs:
        for path in ws.glob(pattern):
            rel = path.relative_to(ws)
            if path.is_symlink() or not path.is_file() or path.stat().st_size > MAX_FILE:
                continue
            if any(p.is_symlink() for p in list(path.parents)[: len(rel.parts) - 1]):
                continue
            seen.add(rel)
    for rel in sorted(seen):
        (Path(dst) / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(ws / rel, Path(dst) / rel)
    return sorted(str(r) for r in seen)


def _open_tree(root, file_mode):
    """chmod a directory tree so another uid can read (and, for 0o666, write) it."""
    for d, dirs, files in os.walk(root):
        os.chmod(d, 0o777 if file_mode == 0o666 else 0o755)
        for f in files:
            os.chmod(os.path.join(d, f), file_mode)


def verify(task_dir, submitted, timeout=60, user=None, argv=None):
    """Run the task's verifier on directory ``submitted``; returns (reward, reason).

    ``user``: run the verifier itself as that uid (root only) on world-readable copies, i.e. a
    verifier that cannot switch uid for its children (the positive control of its isolation).
    ``argv``: the verifier's arguments (default ``--workspace SUBMITTED``).
    """
    with tempfile.TemporaryDirectory(prefix="k3-ver-") as tmp:
        vdir = Path(tmp) / "verifier"
        shutil.copytree(Path(task_dir) / "verifier", vdir)
        shutil.copy(VHARNESS, vdir / VHARNESS.name)  # what k3.tasks.verify writes beside every verifier
        home = Path(tmp) / "home"
        home.mkdir()
        extra = {}
        if user is not None:
            shutil.copytree(submitted, Path(tmp) / "ws")
            submitted = Path(tmp) / "ws"
            _open_tree(vdir, 0o644)
            _open_tree(submitted, 0o666)
            _open_tree(home, 0o666)
            os.chmod(tmp, 0o755)
            extra = {"user": user, "group": user, "extra_groups": []}
        try:
            args = ["--workspace", str(submitted)] if argv is None else argv
            res = subprocess.run([PY, "-I", "-S", str(vdir / "verify.py")] + args,
                                 cwd=submitted, capture_output=True, text=True, timeout=timeout,
                                 env={"PATH": ENV_PATH, "HOME": str(home), "LANG": "C.UTF-8"}, **extra)
        except subprocess.TimeoutExpired:
            return 0.0, "verifier timed out"
    lines = res.stdout.strip().splitlines()
    try:
        out = json.loads(lines[-1])
        reward = float(out["reward"])
    except (IndexError, ValueError, KeyError, TypeError):
        return 0.0, "bad verifier output: %r %r" % (res.stdout[-300:], res.stderr[-300:])
    if not 0.0 <= reward <= 1.0:
        return 0.0, "reward out of range"
    return reward, str(out.get("reason", ""))


def run_checks(ws, timeout=60):
    """Exit code of the visible checks (``python3 checks/run.py``) in workspace ``ws``."""
    res = subprocess.run(["/bin/sh", "-c", "python3 checks/run.py"], cwd=ws, capture_output=True,
                         text=True, timeout=timeout, env={"PATH": ENV_PATH, "HOME": str(ws), "LANG": "C.UTF-8"})
    return res.returncode, res.stdout + res.stderr


class Episode:
    """A task's workspace copy plus the replay state (submissions, rewards)."""

    def __init__(self, task_dir, tmp):
        self.task_dir = Path(task_dir)
        self.cfg = load_task(task_dir)
        self.ws = Path(tmp) / "workspace"
        shutil.copytree(self.task_dir / "workspace", self.ws, symlinks=True)
        shutil.copytree(self.task_dir / "checks", self.ws / "checks", symlinks=True)
        self.tmp = Path(tmp)
        self.rewards = []
        self.submissions = []
        self.refused = 0
        self.log = []

    def call(self, name, args):
        if name == "write":
            path = _inside(self.ws, args["path"])
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(args["content"])
        elif name == "edit":
            path = _inside(self.ws, args["path"])
            text = path.read_text()
            if text.count(args["old"]) != 1:
                raise AssertionError("edit %s: old text occurs %d times" % (args["path"], text.count(args["old"])))
            path.write_text(text.replace(args["old"], args["new"]))
        elif name == "read":
            _inside(self.ws, args["path"]).read_text()
        elif name == "list":
            os.listdir(_inside(self.ws, args.get("path", ".")))
        elif name == "shell":
            res = subprocess.run(["/bin/sh", "-c", args["command"]], cwd=self.ws, capture_output=True,
                                 text=True, timeout=args.get("timeout", 60),
                                 env={"PATH": ENV_PATH, "HOME": str(self.tmp), "LANG": "C.UTF-8"})
            self.log.append((args["command"], res.returncode, res.stdout[-500:] + res.stderr[-500:]))
        elif name == "submit":
            self.submit()
        else:
            raise AssertionError("unknown tool %s" % name)

    def submit(self):
        budget = self.cfg.get("budget", {}).get("submissions", 3)
        if len(self.rewards) >= budget:
            self.refused += 1
            return
        sub = Path(tempfile.mkdtemp(prefix="sub-", dir=self.tmp))
        collect(self.ws, self.cfg.get("submit", ["**/*"]), sub)
        reward, reason = verify(self.task_dir, sub, self.cfg.get("verifier", {}).get("timeout", 60))
        self.rewards.append(reward)
        self.submissions.append((sub, reason))
        self.log.append(("submit", reward, reason))

    def score(self):
        if not self.rewards:
            return 0.0
        use = self.cfg.get("scoring", {}).get("use", "best")
        return max(self.rewards) if use == "best" else self.rewards[-1]


def replay(task_dir, transcript, tmp):
    """Apply ``transcript`` (a dict) to a fresh copy of the task; returns the Episode."""
    ep = Episode(task_dir, tmp)
    allowed = ep.cfg.get("tools", {}).get("allowed", ["shell", "read", "write", "edit", "list", "submit"])
    for turn in transcript["turns"]:
        for call in turn.get("tool_calls", []):
            assert call["name"] in allowed, "tool %s not allowed by the task" % call["name"]
            ep.call(call["name"], call["arguments"])
    return ep


def transcripts(task_dir):
    """[(name, dict)] of the task's solution and hacks."""
    out = [("solution", json.loads((Path(task_dir) / "solution" / "solve.json").read_text()))]
    for path in sorted((Path(task_dir) / "hacks").glob("*.json")):
        out.append(("hacks/" + path.stem, json.loads(path.read_text())))
    return out
