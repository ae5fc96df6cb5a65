"""Sandboxes for tasks and the clean-room verification (SPEC §7.2).

``agent_sandbox(task, sandboxes)`` makes the agent's sandbox: ``workspace/`` copied to /workspace and
``checks/`` to /workspace/checks; nothing of ``verifier/`` and no host path of the task.

``collect_submission(sandbox, globs)`` reads a submission out of the agent's sandbox as data:
the regular files under /workspace whose relative path matches a ``submit`` glob (``*`` and ``?``
stay within one path part, ``**`` spans parts), each at most ``MAX_SUBMIT_FILE`` bytes, no
symlinks, at most ``MAX_SUBMIT_FILES`` files; everything left out is listed with the reason.

``verify(task, files, sandboxes)`` computes the verdict in a FRESH sandbox from the clean base
image: only ``files`` are written to /workspace, ``verifier/`` to /verifier, and it runs
``python3 -I -S /verifier/verify.py`` with cwd /workspace and the fixed ``VERIFIER_ENV`` (``-I``
drops PYTHON* variables and the user site, ``-S`` skips ``site``: no .pth, no sitecustomize).
The verdict is the last stdout line as JSON ``{"reward": r in [0,1], "reason": str}``; anything
else (crash, timeout, bad JSON, reward out of range) is reward 0 with the reason saying so.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

from k3.env.sandbox import Limits, Sandbox, SandboxError
from k3.errors import ConfigError

__all__ = ["Verdict", "Submission", "Sandboxes", "agent_sandbox", "collect_submission", "verify",
           "glob_regex", "VERIFIER_ENV", "MAX_SUBMIT_FILE", "MAX_SUBMIT_FILES"]

VERIFIER_ENV = {"PATH": "/usr/bin:/bin", "HOME": "/tmp/home", "LANG": "C.UTF-8"}
VHARNESS = Path(__file__).with_name("vharness.py")  # the verifier helper every task's verify.py imports
VERIFIER_CMD = ["python3", "-I", "-S", "/verifier/verify.py"]
MAX_SUBMIT_FILE = 1 << 20
MAX_SUBMIT_FILES = 512


@dataclass
class Verdict:
    reward: float
    reason: str
    elapsed: float = 0.0
    timings: dict = field(default_factory=dict)   # create, copy, run, close (seconds)

    def as_dict(self) -> dict:
        return {"reward": self.reward, "reason": self.reason, "elapsed": self.elapsed, "timings": self.timings}


@dataclass
class Submission:
    files: dict[str, bytes]
    skipped: dict[str, str]    # path -> why it was left out

    def manifest(self) -> dict:
        import hashlib

        return {"files": {p: {"sha256": hashlib.sha256(b).hexdigest(), "bytes": len(b)}
                          for p, b in sorted(self.files.items())}, "skipped": dict(sorted(self.skipped.items()))}


class Sandboxes:
    """Makes sandboxes of one isolating backend (``namespace`` by default, or ``vm``); ``local`` is
    refused: it isolates nothing and has no sandbox root for /workspace and /verifier."""

    def __init__(self, backend: str = "namespace", root: str | None = None):
        from k3.env.manager import SandboxManager

        if backend == "local":
            raise ConfigError("tasks cannot run on the 'local' backend: it does not isolate, and the task "
                              "protocol needs a sandbox root with /workspace and /verifier (use namespace or vm)")
        self.backend = backend
        self.manager = SandboxManager(root)
        self.image = self.manager.resolve_image("default")  # built once per host state, then cached

    @property
    def isolating(self) -> bool:
        return True  # local is refused above

    def create(self, network: bool = False, memory_bytes: int | None = 1 << 30) -> Sandbox:
        limits = Limits(memory_bytes=memory_bytes, pids=512, network=network)
        return self.manager.create(self.image, limits, backend=self.backend)

    def close(self) -> None:
        """Nothing to release: each sandbox is closed by its user; the manager holds no process."""


def _copy_tree(sb: Sandbox, src: Path, dest: str, read_only: bool = False) -> int:
    """Write every regular file under ``src`` to ``dest`` inside ``sb``; returns bytes copied."""
    n = 0
    for p in sorted(src.rglob("*")):
        if "__pycache__" in p.parts or p.is_symlink() or not p.is_file():
            continue
        data = p.read_bytes()
        mode = p.stat().st_mode & 0o755 | 0o644
        sb.write_file(f"{dest}/{p.relative_to(src).as_posix()}", data, mode=mode & 0o555 if read_only else mode)
        n += len(data)
    return n


def agent_sandbox(task, sandboxes: Sandboxes) -> Sandbox:
    sb = sandboxes.create(network=False)
    try:
        _copy_tree(sb, task.workspace, "/workspace")
        if task.checks.is_dir():
            _copy_tree(sb, task.checks, "/workspace/checks")
    except BaseException:
        sb.close()
        raise
    return sb


def glob_regex(pattern: str) -> re.Pattern:
    """``*``/``?`` within one path part, ``**/`` any number of parts (also none), ``**`` anything."""
    out, i = [], 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out.append("(?:[^/]+/)*")
            i += 3
        elif pattern.startswith("**", i):
            out.append(".*")
            i += 2
        elif pattern[i] == "*":
            out.append("[^/]*")
            i += 1
        elif pattern[i] == "?":
            out.append("[^/]")
            i += 1
        else:
            out.append(re.escape(pattern[i]))
            i += 1
    return re.compile("".join(out) + r"\Z")


def collect_submission(sb: Sandbox, globs: list[str]) -> Submission:
    pats = [glob_regex(g) for g in globs]
    files: dict[str, bytes] = {}
    skipped: dict[str, str] = {}
    for e in sorted(sb.list("/workspace", recursive=True), key=lambda e: e.path):
        rel = e.path.removeprefix("./")
        if not any(p.match(rel) for p in pats):
            continue
        if e.kind != "file":
            skipped[rel] = f"not a regular file ({e.kind})"
        elif e.size > MAX_SUBMIT_FILE:
            skipped[rel] = f"{e.size} bytes > {MAX_SUBMIT_FILE}"
        elif len(files) >= MAX_SUBMIT_FILES:
            skipped[rel] = f"more than {MAX_SUBMIT_FILES} files"
        else:
            data = sb.read_file("/workspace/" + rel, max_bytes=MAX_SUBMIT_FILE + 1)
            if len(data) > MAX_SUBMIT_FILE:
                skipped[rel] = f"grew past {MAX_SUBMIT_FILE} bytes while read"
            else:
                files[rel] = data
    return Submission(files, skipped)


def parse_verdict(stdout: bytes, exit_code, timed_out: bool) -> tuple[float, str]:
    if timed_out:
        return 0.0, "verifier timed out"
    lines = [x for x in stdout.decode("utf-8", "replace").splitlines() if x.strip()]
    if not lines:
        return 0.0, f"verifier printed nothing (exit code {exit_code})"
    try:
        d = json.loads(lines[-1])
    except ValueError:
        return 0.0, f"verifier's last line is not JSON (exit code {exit_code}): {lines[-1][:200]!r}"
    if not isinstance(d, dict) or set(d) - {"reward", "reason"} or "reward" not in d:
        return 0.0, f"verifier's verdict must be {{reward, reason}}: {lines[-1][:200]!r}"
    r = d["reward"]
    if isinstance(r, bool) or not isinstance(r, (int, float)) or not 0.0 <= r <= 1.0 or r != r:
        return 0.0, f"verifier's reward {r!r} is not a number in [0, 1]"
    return float(r), str(d.get("reason", ""))[:500]


def verify(task, submission: Submission, sandboxes: Sandboxes) -> Verdict:
    t0 = time.monotonic()
    timings = {}
    sb = sandboxes.create(network=False)
    timings["create"] = time.monotonic() - t0
    try:
        t1 = time.monotonic()
        for rel, data in submission.files.items():
            sb.write_file("/workspace/" + rel, data)
        _copy_tree(sb, task.verifier, "/verifier", read_only=True)  # best effort: the sandbox runs as root
        sb.write_file("/verifier/" + VHARNESS.name, VHARNESS.read_bytes(), mode=0o444)
        timings["copy"] = time.monotonic() - t1
        t1 = time.monotonic()
        r = sb.exec(VERIFIER_CMD, timeout=task.verifier_timeout, env=dict(VERIFIER_ENV), cwd="/workspace")
        timings["run"] = time.monotonic() - t1
        reward, reason = parse_verdict(r.stdout, r.exit_code, r.timed_out)
    except SandboxError as e:
        reward, reason = 0.0, f"verification failed: {e}"
    finally:
        t1 = time.monotonic()
        sb.close()
        timings["close"] = time.monotonic() - t1
    return Verdict(reward, reason, round(time.monotonic() - t0, 6), {k: round(v, 6) for k, v in timings.items()})
