"""Sandboxes for tasks and the clean-room verification (SPEC §7.2).

``agent_sandbox(task, sandboxes)`` makes the agent's sandbox: ``workspace/`` copied to /workspace and
``checks/`` to /workspace/checks; nothing of ``verifier/`` and no host path of the task. Both it and
the verifier's sandbox start from the task's ``image`` (k3.tasks.format: the default image, or the
browser image with a headless Chromium).

``collect_submission(sandbox, globs)`` reads a submission out of the agent's sandbox as data:
the regular files under /workspace whose relative path matches a ``submit`` glob (``*`` and ``?``
stay within one path part, ``**`` spans parts), each at most ``MAX_SUBMIT_FILE`` bytes, no
symlinks, at most ``MAX_SUBMIT_FILES`` files; everything left out is listed with the reason.

``verify(task, files, sandboxes)`` computes the verdict in a FRESH nested sandbox (its root can
isolate the processes it starts) from the clean base image: only ``files`` are written to
/workspace, ``verifier/`` to /verifier, and it runs ``python3 -I -S /verifier/verify.py
--verdict-fd 3`` with cwd /workspace and the fixed ``VERIFIER_ENV`` (``-I`` drops PYTHON* variables
and the user site, ``-S`` skips ``site``: no .pth, no sitecustomize).

The verdict channel (SPEC §7.2): fd 3 of the verifier is a pipe to this process, opened with the
command; stdin carries ``{"nonce", "off"}`` (a fresh 128-bit nonce per run). The verdict is
exactly one JSON line on fd 3, ``{"nonce", "reward", "reason", "isolation"}``, carrying the nonce,
from a verifier that exited 0, whose achieved isolation layers include every layer the backend
promises (``promised_layers``). Anything else — no verdict, two, a wrong nonce, a non-zero exit, a
signal, a timeout, a missing layer — is reward 0 with the reason saying which. The verifier's
stdout is never read for the verdict.

``layers_off`` exists for the tests' positive controls only: each named layer (of
``vharness.LAYERS``; ``caps`` = a plain instead of a nested sandbox; ``channel`` = this module's
channel, nonce and exit checks, falling back to the last stdout line) is not applied, and the
reason says so.
"""

from __future__ import annotations

import json
import re
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path

from k3.env.sandbox import Limits, Sandbox, SandboxError
from k3.tasks.vharness import LAYERS
from k3.errors import ConfigError, K3Error

__all__ = ["Verdict", "Submission", "Sandboxes", "agent_sandbox", "collect_submission", "verify",
           "verifier_failed", "VERIFIER_FAILURES", "glob_regex", "VERIFIER_ENV", "MAX_SUBMIT_FILE",
           "MAX_SUBMIT_FILES"]

VERIFIER_ENV = {"PATH": "/usr/bin:/bin", "HOME": "/tmp/home", "LANG": "C.UTF-8"}
VHARNESS = Path(__file__).with_name("vharness.py")  # the verifier helper every task's verify.py imports
VERIFIER_CMD = ["python3", "-I", "-S", "/verifier/verify.py", "--verdict-fd", "3"]
VERIFIER_LAYERS = LAYERS  # what the verifier applies (k3.tasks.vharness)
# ``caps``: in a nested sandbox the verifier holds capabilities (NESTED_CAPS) its children never do,
# and the kernel refuses ptrace-level access (/proc/<pid>/fd, mem, environ, cwd; ptrace) to a
# process whose permitted capabilities are not a subset of the caller's. Off = a plain sandbox,
# which also takes pidns, uid and roroot (they need those capabilities).
CONTROL_LAYERS = VERIFIER_LAYERS + ("caps", "channel")
NEEDS_CAPS = ("pidns", "uid", "roroot")
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
    refused: it isolates nothing and has no sandbox root for /workspace and /verifier.

    ``owner`` names every sandbox it makes ``<owner>-<random>``: sandboxes outlive the process that
    made them (by design: any process may attach), so a driver killed with SIGKILL leaves its live
    ones behind, and the next driver of the same owner closes them (``close_owned``)."""

    def __init__(self, backend: str = "namespace", root: str | None = None, owner: str | None = None):
        from k3.env.manager import SandboxManager

        self.owner = owner
        if backend == "local":
            raise ConfigError("tasks cannot run on the 'local' backend: it does not isolate, and the task "
                              "protocol needs a sandbox root with /workspace and /verifier (use namespace or vm)")
        self.backend = backend
        self.manager = SandboxManager(root)
        self.image = self.manager.resolve_image("default")  # built once per host state, then cached
        self._images = {"default": self.image}   # name -> image id, each resolved on first use

    @property
    def isolating(self) -> bool:
        return True  # local is refused above

    def create(self, network: bool = False, memory_bytes: int | None = 1 << 30, nested: bool = False,
               image: str = "default") -> Sandbox:
        """A sandbox of ``image`` (``"default"`` or ``"browser"``, k3.env.images)."""
        if image not in self._images:
            self._images[image] = self.manager.resolve_image(image)
        limits = Limits(memory_bytes=memory_bytes, pids=512, network=network)
        name = None if self.owner is None else f"{self.owner}-{secrets.token_hex(6)}"
        return self.manager.create(self._images[image], limits, backend=self.backend, nested=nested, name=name)

    def close_owned(self) -> list[str]:
        """Close every sandbox of this owner, and remove one its maker died while making: what an
        earlier, killed driver left (call it only when no process of this owner runs); their ids.
        Each is tried: one that cannot be closed (a cgroup still busy) does not keep the others,
        and a ``SandboxError`` naming those left follows (``k3 env gc`` removes them later)."""
        if self.owner is None:
            return []
        closed, failed = [], []

        def attempt(sid: str, close) -> None:
            try:
                close()
                closed.append(sid)
            except (K3Error, OSError) as e:
                failed.append(f"{sid}: {e}")

        for st in self.manager.list():
            if str(st.get("name") or "").startswith(self.owner + "-"):
                attempt(st["id"], lambda sid=st["id"]: self.manager.get(sid).close())
        for sid, name in self.manager.unmade():
            if str(name or "").startswith(self.owner + "-"):
                attempt(sid, lambda sid=sid: self.manager.remove_unmade(sid))
        if failed:
            raise SandboxError(f"closed {len(closed)} sandboxes of {self.owner}, could not close "
                               f"{len(failed)} ({'; '.join(failed)})")
        return closed

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
    sb = sandboxes.create(network=False, image=getattr(task, "image", "default"))
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
    """The verdict as the last stdout line: only for ``layers_off={"channel"}`` (a positive control)."""
    if timed_out:
        return 0.0, "verifier timed out"
    lines = [x for x in stdout.decode("utf-8", "replace").splitlines() if x.strip()]
    if not lines:
        return 0.0, f"verifier printed nothing (exit code {exit_code})"
    try:
        d = json.loads(lines[-1])
    except ValueError:
        return 0.0, f"verifier's last line is not JSON (exit code {exit_code}): {lines[-1][:200]!r}"
    return _reward(d, lines[-1], {"reward", "reason", "isolation", "nonce"})


def _reward(d, line: str, keys: set) -> tuple[float, str]:
    if not isinstance(d, dict) or set(d) - keys or "reward" not in d:
        return 0.0, f"verifier's verdict must be {{{', '.join(sorted(keys))}}}: {line[:200]!r}"
    r = d["reward"]
    if isinstance(r, bool) or not isinstance(r, (int, float)) or not 0.0 <= r <= 1.0 or r != r:
        return 0.0, f"verifier's reward {r!r} is not a number in [0, 1]"
    return float(r), str(d.get("reason", ""))[:500]


# How the reasons of a verdict begin when the verifier did not judge the submission (it crashed, was
# killed, timed out or gave no verdict): the reward is 0 and RL counts these episodes apart.
VERIFIER_FAILURES = ("verifier timed out", "verifier exited", "verifier was killed", "verifier printed nothing",
                     "no verdict on the verdict channel", "verification failed")


def verifier_failed(reason: str) -> bool:
    return reason.startswith(VERIFIER_FAILURES)


def channel_verdict(channel: bytes | None, nonce: str, exit_code, timed_out: bool,
                    required: set) -> tuple[float, str]:
    """The verdict from the channel (module docstring): reward 0 unless everything holds."""
    if timed_out:
        return 0.0, "verifier timed out"
    if exit_code != 0:
        how = f"was killed by signal {exit_code - 128}" if exit_code is not None and exit_code > 128 \
            else f"exited with code {exit_code}"
        return 0.0, f"verifier {how}: no verdict counts"
    lines = [x for x in (channel or b"").decode("utf-8", "replace").splitlines() if x.strip()]
    if len(lines) != 1:
        return 0.0, (f"{len(lines)} verdicts on the verdict channel: exactly one counts" if lines
                     else "no verdict on the verdict channel")
    try:
        d = json.loads(lines[0])
    except ValueError:
        return 0.0, f"the verdict is not JSON: {lines[0][:200]!r}"
    if not isinstance(d, dict) or not isinstance(d.get("nonce"), str) or \
            not secrets.compare_digest(d["nonce"], nonce):
        return 0.0, "the verdict does not carry this run's nonce"
    isolation = d.get("isolation")
    if not isinstance(isolation, list) or not all(isinstance(x, str) for x in isolation):
        return 0.0, f"the verdict's isolation must be a list of layer names: {isolation!r}"
    missing = sorted(required - set(isolation))
    if missing:
        return 0.0, f"isolation unavailable: the verifier could not apply {', '.join(missing)}"
    return _reward({k: v for k, v in d.items() if k != "nonce"}, lines[0], {"reward", "reason", "isolation"})


def promised_layers(sb: Sandbox) -> set:
    """What a namespace sandbox guarantees the verifier can apply (a nested one: every layer,
    Landlock where the kernel has it)."""
    desc = sb.describe()
    if desc.get("backend") != "namespace":
        raise SandboxError(f"sandbox {sb.id}: verification needs the namespace backend (the verdict channel "
                           f"and nested isolation); {desc.get('backend')} has neither")
    out = set(VERIFIER_LAYERS) - (set() if desc.get("landlock", 0) >= 1 else {"landlock"})
    return out if desc.get("nested") else out - set(NEEDS_CAPS)


def verify(task, submission: Submission, sandboxes: Sandboxes, layers_off=()) -> Verdict:
    off = set(layers_off)
    if off - set(CONTROL_LAYERS):
        raise ConfigError(f"verify: unknown layers_off {sorted(off - set(CONTROL_LAYERS))}; "
                          f"known: {', '.join(CONTROL_LAYERS)}")
    if "caps" in off:
        off |= set(NEEDS_CAPS)
    t0 = time.monotonic()
    timings = {}
    try:
        sb = sandboxes.create(network=False, nested="caps" not in off, image=getattr(task, "image", "default"))
    except SandboxError as e:
        return Verdict(0.0, f"isolation unavailable: {e}", round(time.monotonic() - t0, 6), {})
    timings["create"] = time.monotonic() - t0
    nonce = secrets.token_hex(16)
    try:
        required = promised_layers(sb) - off
        t1 = time.monotonic()
        for rel, data in submission.files.items():
            sb.write_file("/workspace/" + rel, data)
        _copy_tree(sb, task.verifier, "/verifier", read_only=True)  # best effort: the sandbox runs as root
        sb.write_file("/verifier/" + VHARNESS.name, VHARNESS.read_bytes(), mode=0o444)
        timings["copy"] = time.monotonic() - t1
        t1 = time.monotonic()
        config = json.dumps({"nonce": nonce, "off": sorted(off - {"channel"})}).encode() + b"\n"
        cmd = VERIFIER_CMD[:-1] + ["1"] if "channel" in off else VERIFIER_CMD  # the control: verdict on stdout
        r = sb.exec(cmd, timeout=task.verifier_timeout, env=dict(VERIFIER_ENV), cwd="/workspace",
                    stdin=config, channel="channel" not in off)
        timings["run"] = time.monotonic() - t1
        if "channel" in off:
            reward, reason = parse_verdict(r.stdout, r.exit_code, r.timed_out)
        else:
            reward, reason = channel_verdict(r.channel, nonce, r.exit_code, r.timed_out, required)
        if off:
            reason = f"{reason} [CONTROL: layers off: {', '.join(sorted(off))}]"
    except SandboxError as e:
        reward, reason = 0.0, f"verification failed: {e}"
    finally:
        t1 = time.monotonic()
        sb.close()
        timings["close"] = time.monotonic() - t1
    return Verdict(reward, reason, round(time.monotonic() - t0, 6), {k: round(v, 6) for k, v in timings.items()})
