"""Verifier helper shared by every task: ``k3.rl.verify`` writes this file to ``/verifier/vharness.py``
beside each task's own verifier files (a task never carries a copy; ``k3 task validate`` refuses one).
Stdlib only: the verifier runs as ``python3 -I -S /verifier/verify.py`` in a clean sandbox, where
this file is imported from its directory, not from the k3 package.

Contract of a ``verify.py``::

    sys.path.insert(0, <its own directory>); import vharness
    def check(ctx) -> (reward, reason)     # raise vharness.Fail(reason) for reward 0
    vharness.main(check, __file__)

The workspace (default ``/workspace``; overridable ONLY by the ``--workspace PATH`` command-line
argument) is untrusted data: it is copied into a private run directory and its code is only ever
executed in child processes started here (``python3 -I -S``, env = PATH/HOME/LANG only, a timeout),
never imported into the verifier process. Children never decide the verdict: they print raw
results after a marker and the verifier compares them with its own reference.

Isolation of the verifier's own files from workspace code (best effort, recorded in the reason):
``uid``: when root and able to switch uid, the verifier directory is made 0700 and children run as
uid/gid 65534; ``removed``: otherwise, when running from ``/verifier`` itself, its files are deleted
after this process has loaded them (a fresh sandbox is made for every verification); ``none``.
"""

import json
import os
import shutil
import subprocess
import sys
import tempfile

NOBODY = 65534
MARK = "@@K3-VERIFY-RESULT@@"
CHILD_PATH = "/usr/bin:/bin"


class Fail(Exception):
    """The submission is wrong; the message is the verdict's reason (reward 0)."""


def _probe_drop(cwd):
    """True when children can be started as uid/gid 65534 (root, with setuid/setgroups allowed)."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return False
    try:
        res = subprocess.run([sys.executable, "-I", "-S", "-c", "pass"], cwd=cwd, user=NOBODY,
                             group=NOBODY, extra_groups=[], env={"PATH": CHILD_PATH},
                             capture_output=True, timeout=20)
    except (OSError, subprocess.SubprocessError, ValueError):
        return False
    return res.returncode == 0


class Context:
    """One verification: a private run directory, copies of the workspace, child runners."""

    def __init__(self, workspace, verifier_dir):
        self.workspace = os.path.abspath(workspace)
        self.verifier_dir = os.path.abspath(verifier_dir)
        self.tmp = tempfile.mkdtemp(prefix="k3-verify-")
        os.chmod(self.tmp, 0o755)
        self._n = 0
        self.drop = _probe_drop(self.tmp)
        self.isolation = self._isolate()

    def _isolate(self):
        if self.drop:
            try:
                os.chmod(self.verifier_dir, 0o700)
                st = os.stat(self.verifier_dir)
                if st.st_mode & 0o077 == 0 and st.st_uid != NOBODY:
                    return "uid"
            except OSError:
                pass
        if os.path.realpath(self.verifier_dir) == "/verifier":
            for name in os.listdir(self.verifier_dir):
                path = os.path.join(self.verifier_dir, name)
                try:
                    shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
                except OSError:
                    pass
            if not os.listdir(self.verifier_dir):
                return "removed"
        return "none"

    def fresh(self, files=None):
        """A new private copy of the workspace (+ ``files``: {relpath: str|bytes}); returns its path."""
        self._n += 1
        dst = os.path.join(self.tmp, "ws%d" % self._n)
        shutil.copytree(self.workspace, dst, symlinks=True)
        for rel, data in (files or {}).items():
            path = os.path.join(dst, rel)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "wb") as f:
                f.write(data.encode() if isinstance(data, str) else data)
        if self.drop:
            for root, dirs, names in os.walk(dst):
                for name in [root] + [os.path.join(root, n) for n in dirs + names]:
                    os.lchown(name, NOBODY, NOBODY)
        return dst

    def run(self, argv, cwd, stdin=None, timeout=10.0):
        """Run ``argv`` as an untrusted child; returns CompletedProcess (text). Timeout -> Fail."""
        home = os.path.join(self.tmp, "home")
        os.makedirs(home, exist_ok=True)
        if self.drop:
            os.chown(home, NOBODY, NOBODY)
        extra = {"user": NOBODY, "group": NOBODY, "extra_groups": []} if self.drop else {}
        try:
            return subprocess.run(argv, cwd=cwd, input=stdin, capture_output=True, text=True,
                                  errors="replace", timeout=timeout,
                                  env={"PATH": CHILD_PATH, "HOME": home, "LANG": "C.UTF-8"}, **extra)
        except subprocess.TimeoutExpired:
            raise Fail("timed out after %.0f s: %s" % (timeout, " ".join(argv)[:120]))

    def python(self, code, cwd, stdin=None, timeout=10.0, args=()):
        """Run ``code`` with this interpreter (``-I -S``) as an untrusted child."""
        return self.run([sys.executable, "-I", "-S", "-c", code] + list(args), cwd, stdin, timeout)

    def results(self, code, cwd, payload=None, timeout=10.0):
        """Run driver ``code`` (which calls ``emit(obj)`` once) with ``payload`` as JSON on stdin.

        The driver gets ``emit`` and ``payload`` predefined and the workspace copy on sys.path[0];
        returns the emitted object. A crash or no result -> Fail.
        """
        prologue = ("import json, sys\npayload = json.loads(sys.stdin.read())\n"
                    "def emit(obj):\n    sys.stdout.write('\\n%s' + json.dumps(obj, default=repr) + '\\n')\n"
                    "    sys.stdout.flush()\n"
                    "sys.path.insert(0, %r)\n") % (MARK, cwd)
        res = self.python(prologue + code, cwd, json.dumps(payload), timeout)
        lines = [ln for ln in res.stdout.splitlines() if ln.startswith(MARK)]
        if not lines:
            raise Fail("workspace code gave no result (exit %d): %s" % (res.returncode, res.stderr.strip()[-300:]))
        return json.loads(lines[-1][len(MARK):])

    def close(self):
        shutil.rmtree(self.tmp, ignore_errors=True)


def norm(obj):
    """``obj`` as it comes back through JSON (tuples -> lists), for comparing with child results."""
    return json.loads(json.dumps(obj))


def read_text(ws, rel):
    """Text of a workspace file; missing/unreadable -> Fail naming it."""
    path = os.path.join(ws, rel)
    if os.path.islink(path) or not os.path.isfile(path):
        raise Fail("missing file: %s" % rel)
    with open(path, encoding="utf-8", errors="replace") as f:
        return f.read()


def main(check, verify_file, argv=None):
    """Parse ``--workspace PATH``, run ``check(ctx)``, print the verdict as the last stdout line."""
    argv = sys.argv[1:] if argv is None else argv
    workspace = "/workspace"
    if argv[:1] == ["--workspace"] and len(argv) == 2:
        workspace = argv[1]
    elif argv:
        print(json.dumps({"reward": 0.0, "reason": "verifier usage: verify.py [--workspace PATH]"}))
        return 2
    ctx = None
    try:
        ctx = Context(workspace, os.path.dirname(os.path.abspath(verify_file)))
        reward, reason = check(ctx)
    except Fail as e:
        reward, reason = 0.0, str(e)
    except Exception as e:  # a verifier bug is reward 0, stated as such
        reward, reason = 0.0, "verifier error: %s: %s" % (type(e).__name__, e)
    finally:
        if ctx is not None:
            ctx.close()
    if ctx is not None:
        reason = "%s [isolation: %s]" % (reason, ctx.isolation)
    print(json.dumps({"reward": max(0.0, min(1.0, float(reward))), "reason": str(reason)[:600]}))
    return 0
