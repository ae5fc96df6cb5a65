"""Verifier helper shared by every task: ``k3.tasks.verify`` writes this file to ``/verifier/vharness.py``
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

The verdict (SPEC §7.2, docs/AGENTS.md "The verdict's threat model"): run by k3, the verifier is
``verify.py --verdict-fd 3``: it reads one JSON line from stdin, ``{"nonce", "off"}``, before it
touches the workspace, then closes stdin and keeps fd 3 (the channel k3 opened) close-on-exec;
its one verdict, ``{"nonce", "reward", "reason", "isolation"}``, goes there, never to stdout. Run
by hand (no ``--verdict-fd``), it prints the verdict line to stdout.

Layers between workspace code and the verifier, each applied unless k3 names it in ``off`` (the
tests' positive controls) and listed in the verdict's ``isolation`` when achieved:

``nodump``    this process is non-dumpable: its /proc/<pid>/{fd,mem,environ,cwd,...} and
              ptrace/process_vm_readv need CAP_SYS_PTRACE, which children never have;
``pidns``     each child runs as pid 1 of its own PID namespace with a fresh /proc: it cannot
              name, signal or look at the verifier, and when it exits the kernel kills every
              process it left (nothing outlives its run);
``uid``       children run as uid/gid 65534 (the verifier is 0): the verifier's directory is
              0700, its /proc files and signals are another user's;
``roroot``    children see the root read-only, a private empty /tmp, and only their own copy of
              the workspace and HOME writable (no replaced interpreter or tool for a later child);
``landlock``  each child enters its own Landlock domain: no ptrace of, and (kernel ABI >= 6) no
              signal to, a process outside it;
``removed``   run from /verifier, the verifier's files are deleted once this process has loaded
              them.

Every child also loses all capabilities (bounding, ambient, inheritable) and gets no_new_privs.
"""

import ctypes
import fcntl
import json
import os
import shutil
import subprocess
import sys
import tempfile

NOBODY = 65534
MARK = "@@K3-VERIFY-RESULT@@"
CHILD_PATH = "/usr/bin:/bin"
LAYERS = ("nodump", "pidns", "uid", "roroot", "landlock", "removed")
CHILD_LAYERS = ("pidns", "uid", "roroot", "landlock")   # applied by SPAWN in each child
_libc = ctypes.CDLL(None, use_errno=True)

# The child launcher: ``python3 -I -S -c SPAWN SPEC ARGV...``. It makes the namespaces, forks the
# child (pid 1 of the new PID namespace), waits for it and exits with its status (128 + signal
# when killed). The child mounts, drops uid and capabilities, enters Landlock, then execs ARGV.
# SPEC: {"layers": [...], "binds": [writable dirs], "uid": int, "probe": bool}; with "probe" a
# layer that fails is skipped and the child prints the layers it achieved instead of exec'ing.
SPAWN = r"""
import ctypes, json, os, sys
spec = json.loads(sys.argv[1]); argv = sys.argv[2:]
want, probe, got = set(spec["layers"]), spec["probe"], []
libc = ctypes.CDLL(None, use_errno=True)
NEWNS, NEWPID, REC, PRIVATE, BIND, REMOUNT, RDONLY = 0x20000, 0x20000000, 0x4000, 0x40000, 0x1000, 0x20, 1
NOSUID, NODEV, NOEXEC = 2, 4, 8
def fail(what):
    os.write(2, ("k3 verifier child: %s failed: %s\n" % (what, os.strerror(ctypes.get_errno()))).encode())
    os._exit(125)
def step(layer, ok, what):
    if ok:
        got.append(layer)
    elif not probe:
        fail(what)
if want & {"pidns", "roroot"}:
    if libc.unshare(NEWNS | (NEWPID if "pidns" in want else 0)) != 0:
        if not probe:
            fail("unshare")
        want -= {"pidns", "roroot"}
exe = None if not argv else argv[0] if "/" in argv[0] else next(
    (os.path.join(d, argv[0]) for d in os.environ.get("PATH", "").split(":")
     if d and os.access(os.path.join(d, argv[0]), os.X_OK)), argv[0])  # found now: execv imports nothing
pid = os.fork()
if pid:
    code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    os._exit(code if code >= 0 else 128 - code)
libc.prctl(1, 9)  # PR_SET_PDEATHSIG SIGKILL: the launcher killed (a timeout) takes the child along
if want & {"pidns", "roroot"} and libc.mount(None, b"/", None, REC | PRIVATE, None) != 0:
    fail("private mounts")
if "pidns" in want:
    step("pidns", libc.mount(b"proc", b"/proc", b"proc", NOSUID | NODEV | NOEXEC, None) == 0, "a fresh /proc")
if "roroot" in want:
    fds = [os.open(p, os.O_PATH | os.O_DIRECTORY) for p in spec["binds"]]
    ok = libc.mount(b"tmpfs", b"/tmp", b"tmpfs", NOSUID | NODEV, b"mode=1777,size=256m") == 0
    for p, fd in zip(spec["binds"], fds):
        os.makedirs(p, exist_ok=True)
        ok = ok and libc.mount(b"/proc/self/fd/%d" % fd, p.encode(), None, BIND | REC, None) == 0
        os.close(fd)
    ok = ok and libc.mount(None, b"/", None, REMOUNT | BIND | RDONLY, None) == 0
    step("roroot", ok, "the read-only root")
    os.chdir(os.getcwd())  # the same path, now through the writable bind
for cap in range(64):
    libc.prctl(24, cap, 0, 0, 0)  # PR_CAPBSET_DROP (fails quietly without CAP_SETPCAP or past the last cap)
libc.prctl(47, 4, 0, 0, 0)  # PR_CAP_AMBIENT_CLEAR_ALL
if "uid" in want:
    try:
        os.setgroups([])
        os.setgid(spec["uid"])
        os.setuid(spec["uid"])
        ok = os.getuid() == spec["uid"]
    except OSError:
        ok = False
    step("uid", ok, "the uid switch")
    libc.prctl(1, 9)  # a uid change clears the parent-death signal
hdr, data = (ctypes.c_uint32 * 2)(0x20080522, 0), (ctypes.c_uint32 * 6)()
if libc.capset(hdr, data) != 0:
    fail("dropping capabilities")
if libc.prctl(38, 1, 0, 0, 0) != 0:  # PR_SET_NO_NEW_PRIVS
    fail("no_new_privs")
if "landlock" in want:
    abi = libc.syscall(444, None, 0, 1)
    attr = (ctypes.c_uint64 * 3)(1 << 11, 0, 3 if abi >= 6 else 0)  # MAKE_BLOCK; scope signals + abstract sockets
    fd = libc.syscall(444, attr, ctypes.sizeof(attr) if abi >= 6 else 8, 0) if abi >= 1 else -1
    step("landlock", fd >= 0 and libc.syscall(446, fd, 0) == 0, "Landlock")
if probe:
    print(json.dumps(sorted(got)))
    sys.stdout.flush()
    os._exit(0)
try:
    os.execv(exe, argv)
except OSError as e:
    os.write(2, ("k3 verifier child: %s: %s\n" % (argv[0], e.strerror)).encode())
    os._exit(127)
"""


class Fail(Exception):
    """The submission is wrong; the message is the verdict's reason (reward 0)."""


class Context:
    """One verification: a private run directory, copies of the workspace, child runners.
    ``off``: layers not to apply (k3 passes them for the tests' positive controls only)."""

    def __init__(self, workspace, verifier_dir, off=()):
        self.workspace = os.path.abspath(workspace)
        self.verifier_dir = os.path.abspath(verifier_dir)
        self.off = set(off)
        self.layers = set()
        if "nodump" not in self.off and _libc.prctl(4, 0, 0, 0, 0) == 0:  # PR_SET_DUMPABLE 0
            self.layers.add("nodump")
        self.tmp = tempfile.mkdtemp(prefix="k3-verify-")
        os.chmod(self.tmp, 0o755)
        self._n = 0
        self.home = os.path.join(self.tmp, "home")
        os.makedirs(self.home)
        self._child_layers = self._probe()
        self.drop = "uid" in self._child_layers
        self.layers |= self._protect_files() | set(self._child_layers)
        if self.drop:
            os.chown(self.home, NOBODY, NOBODY)

    @property
    def isolation(self):
        """The layers achieved, in LAYERS order."""
        return [x for x in LAYERS if x in self.layers]

    @staticmethod
    def _spawn_argv(argv, binds, layers, probe=False):
        spec = {"layers": list(layers), "binds": binds, "uid": NOBODY, "probe": probe}
        return [sys.executable, "-I", "-S", "-c", SPAWN, json.dumps(spec)] + list(argv)

    def _probe(self):
        """The child layers this host can give (the launcher run once in probe mode)."""
        wanted = [x for x in CHILD_LAYERS if x not in self.off]
        if not wanted:
            return []
        try:
            res = subprocess.run(self._spawn_argv([], [self.home], wanted, probe=True), cwd=self.tmp,
                                 capture_output=True, text=True, timeout=30, env={"PATH": CHILD_PATH})
            got = json.loads(res.stdout.strip().splitlines()[-1]) if res.returncode == 0 else []
        except (OSError, subprocess.SubprocessError, ValueError, IndexError):
            got = []
        return [x for x in CHILD_LAYERS if x in got]

    def _protect_files(self):
        """Keep the verifier's own files from children: 0700 when they run as another uid, and
        deleted when this runs from /verifier (each verification is a fresh sandbox)."""
        done = set()
        if self.drop:
            try:
                os.chmod(self.verifier_dir, 0o700)
                st = os.stat(self.verifier_dir)
            except OSError:
                st = None
            if st is None or st.st_mode & 0o077 or st.st_uid == NOBODY:
                self.drop = False  # the files stay readable: children must not run as another uid here
                self._child_layers = [x for x in self._child_layers if x != "uid"]
        if "removed" not in self.off and os.path.realpath(self.verifier_dir) == "/verifier":
            for name in os.listdir(self.verifier_dir):
                path = os.path.join(self.verifier_dir, name)
                try:
                    shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
                except OSError:
                    pass
            if not os.listdir(self.verifier_dir):
                done.add("removed")
        return done

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
        """Run ``argv`` as an untrusted child (the layers above); returns CompletedProcess (text).
        Timeout -> Fail. ``cwd`` (a copy from ``fresh``) and HOME are its only writable places
        under ``roroot``."""
        binds = [os.path.abspath(cwd), self.home]
        p = subprocess.Popen(self._spawn_argv(argv, binds, self._child_layers), cwd=cwd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, errors="replace",
                             env={"PATH": CHILD_PATH, "HOME": self.home, "LANG": "C.UTF-8"})
        try:
            out, err = p.communicate(stdin, timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()  # the launcher; its child dies with it (PDEATHSIG), and with pidns all it left
            try:
                p.communicate(timeout=5)
            except subprocess.TimeoutExpired:  # a process outside any PID namespace holds the pipes
                pass
            raise Fail("timed out after %.0f s: %s" % (timeout, " ".join(argv)[:120]))
        return subprocess.CompletedProcess(argv, p.returncode, out, err)

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


def _take_channel(fd):
    """The k3 run's config from stdin, and fd ``fd`` moved close-on-exec above 9 (no child inherits it)."""
    config = json.loads(sys.stdin.readline())
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    chan = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 10)
    os.close(fd)
    return config, chan


def main(check, verify_file, argv=None):
    """Parse ``[--workspace PATH] [--verdict-fd N]``, run ``check(ctx)``, give the verdict (above)."""
    argv = sys.argv[1:] if argv is None else argv
    opts, usage = {"--workspace": "/workspace", "--verdict-fd": None}, False
    while argv:
        if len(argv) < 2 or argv[0] not in opts:
            usage = True
            break
        opts[argv[0]], argv = argv[1], argv[2:]
    config, chan = {}, None
    if opts["--verdict-fd"] is not None:
        config, chan = _take_channel(int(opts["--verdict-fd"]))
    ctx = None
    if usage:
        reward, reason = 0.0, "verifier usage: verify.py [--workspace PATH] [--verdict-fd N]"
    else:
        try:
            ctx = Context(opts["--workspace"], os.path.dirname(os.path.abspath(verify_file)), config.get("off", ()))
            reward, reason = check(ctx)
        except Fail as e:
            reward, reason = 0.0, str(e)
        except Exception as e:  # a verifier bug is reward 0, stated as such
            reward, reason = 0.0, "verifier error: %s: %s" % (type(e).__name__, e)
        finally:
            if ctx is not None:
                ctx.close()
    isolation = ctx.isolation if ctx is not None else []
    reason = "%s [isolation: %s]" % (reason, ",".join(isolation) or "none")
    verdict = {"reward": max(0.0, min(1.0, float(reward))), "reason": str(reason)[:600], "isolation": isolation}
    if chan is None:
        print(json.dumps(verdict))
    else:
        os.write(chan, (json.dumps({"nonce": config.get("nonce"), **verdict}) + "\n").encode())
        os.close(chan)
    return 2 if usage else 0
