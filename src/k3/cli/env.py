"""``k3 env``: sandboxes from the command line (each call is a new process; sandboxes persist).

    k3 env create [--backend namespace|local|vm] [--image default|ID] [--workspace DIR] [--name N]
                  [--memory 512M|none] [--pids N|none] [--cpus F] [--network]
    k3 env exec ID [--timeout S] [--cwd DIR] [--env K=V]... -- CMD [ARG...]   (exit code = CMD's)
    k3 env snapshot ID | fork SNAPSHOT [--backend B] [--name N] | restore ID SNAPSHOT
    k3 env pause ID | resume ID | ls [--snapshots] [--json] | rm ID... | rm --snapshot SNAP... | gc
    k3 env build-image [--python PATH] [--from DIR] [--debootstrap SUITE [--mirror URL]]

``--root DIR`` (before the subcommand) picks the manager root (default ``$K3_ENV_HOME``).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile

from k3.env.images import default_image, import_image
from k3.env.manager import SandboxManager
from k3.env.sandbox import Limits, SandboxError

__all__ = ["env_main", "parse_size"]

_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(text: str, flag: str) -> int | None:
    """"512M" -> 536870912, "none" -> None; binary units K, M, G, T (a trailing B or iB is allowed)."""
    t = text.strip().upper()
    if t == "NONE":
        return None
    for suffix in ("IB", "B"):
        if t.endswith(suffix) and len(t) > len(suffix) and t[-len(suffix) - 1] in "KMGT":
            t = t[:-len(suffix)]
    unit = t[-1] if t and t[-1] in _UNITS else ""
    try:
        n = float(t[:-1] if unit else t) * _UNITS[unit]
    except ValueError:
        raise SandboxError(f"{flag}: {text!r} is not a size (e.g. 512M, 2G, none)") from None
    if n <= 0 or n != int(n):
        raise SandboxError(f"{flag}: {text!r} must be a positive whole number of bytes")
    return int(n)


def _count(text: str, flag: str) -> int | None:
    if text.lower() == "none":
        return None
    try:
        return int(text)
    except ValueError:
        raise SandboxError(f"{flag}: {text!r} is not a whole number (or none)") from None


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="k3 env", description="sandboxes (SPEC §7.1)")
    p.add_argument("--root", help="manager root (default $K3_ENV_HOME or ~/.cache/k3/env)")
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("create", help="create a sandbox; prints its id")
    c.add_argument("--backend", default="namespace")
    c.add_argument("--image", default="default")
    c.add_argument("--workspace", help="host directory copied into /workspace")
    c.add_argument("--name")
    c.add_argument("--memory", default="512M", help="memory limit (512M, 2G, none)")
    c.add_argument("--pids", default="256", help="process limit (or none)")
    c.add_argument("--cpus", type=float, help="CPU bandwidth in cores")
    c.add_argument("--network", action="store_true", help="share the host network (default: none)")
    c.add_argument("--output-bytes", type=int, default=1 << 20, help="per-stream output cap of exec")
    e = sub.add_parser("exec", help="run a command inside; exits with its exit code (124 on timeout)")
    e.add_argument("id")
    e.add_argument("--timeout", type=float, default=600.0)
    e.add_argument("--cwd")
    e.add_argument("--env", action="append", default=[], metavar="K=V")
    e.add_argument("command", nargs="*", help="after --: argv; one word without --: a shell command line")
    for name, help_ in (("snapshot", "snapshot a sandbox; prints the snapshot id"), ("pause", "freeze every process"),
                        ("resume", "thaw a paused sandbox")):
        sub.add_parser(name, help=help_).add_argument("id")
    f = sub.add_parser("fork", help="new sandbox from a snapshot; prints its id")
    f.add_argument("snapshot")
    f.add_argument("--backend")
    f.add_argument("--name")
    r = sub.add_parser("restore", help="roll a sandbox back to a snapshot")
    r.add_argument("id")
    r.add_argument("snapshot")
    ls = sub.add_parser("ls", help="list sandboxes (or snapshots)")
    ls.add_argument("--snapshots", action="store_true")
    ls.add_argument("--json", action="store_true")
    rm = sub.add_parser("rm", help="close and remove sandboxes (or remove snapshots)")
    rm.add_argument("ids", nargs="+")
    rm.add_argument("--snapshot", action="store_true", help="the ids are snapshot ids")
    sub.add_parser("gc", help="end dead sandboxes, delete unreferenced layers and objects")
    b = sub.add_parser("build-image", help="build the default image (or import a root); prints its id")
    b.add_argument("--python", help="host interpreter for the default image")
    b.add_argument("--from", dest="src", help="import this root directory instead")
    b.add_argument("--debootstrap", metavar="SUITE", help="build a Debian root with debootstrap")
    b.add_argument("--mirror", help="Debian mirror for --debootstrap")
    return p


def _create(m: SandboxManager, a) -> int:
    limits = Limits(memory_bytes=parse_size(a.memory, "--memory"), pids=_count(a.pids, "--pids"), cpus=a.cpus,
                    network=a.network, output_bytes=a.output_bytes)
    print(m.create(image=a.image, limits=limits, backend=a.backend, workspace=a.workspace, name=a.name).id)
    return 0


def _exec(m: SandboxManager, a, cmd: list[str]) -> int:
    if not cmd:
        raise SandboxError("k3 env exec: no command given (k3 env exec ID -- CMD ...)")
    env = {}
    for kv in a.env:
        if "=" not in kv:
            raise SandboxError(f"--env {kv!r}: expected K=V")
        k, v = kv.split("=", 1)
        env[k] = v
    res = m.get(a.id).exec(cmd[0] if len(cmd) == 1 else cmd, timeout=a.timeout, env=env, cwd=a.cwd)
    sys.stdout.buffer.write(res.stdout)
    sys.stdout.flush()
    sys.stderr.buffer.write(res.stderr)
    if res.truncated:
        print(f"k3 env exec: output truncated at {m.get(a.id).limits.output_bytes} bytes per stream", file=sys.stderr)
    if res.oom_killed:
        print("k3 env exec: killed by the sandbox's memory limit", file=sys.stderr)
    if res.timed_out:
        print(f"k3 env exec: timed out after {a.timeout} s (process group killed)", file=sys.stderr)
        return 124
    return res.exit_code if res.exit_code is not None else 1


def _ls(m: SandboxManager, a) -> int:
    if a.snapshots:
        rows = [{"id": s.id, "backend": s.backend, "parent": s.parent, "bytes": s.bytes, "created": s.created}
                for s in m.snapshots()]
        cols = ("id", "backend", "bytes", "parent")
    else:
        rows = [{"id": s["id"], "name": s.get("name") or "", "backend": s["backend"],
                 "paused": bool(s.get("paused")), "origin": s.get("origin") or ""} for s in m.list()]
        cols = ("id", "name", "backend", "paused", "origin")
    if a.json:
        print(json.dumps(rows))
    else:
        print("  ".join(cols))
        for r in rows:
            print("  ".join(str(r[c]) for c in cols))
    return 0


def _build_image(m: SandboxManager, a) -> int:
    if a.src and a.debootstrap:
        raise SandboxError("build-image: --from and --debootstrap exclude each other")
    if a.mirror and not a.debootstrap:
        raise SandboxError("build-image: --mirror needs --debootstrap")
    if a.src:
        print(import_image(m.store, a.src))
    elif a.debootstrap:
        tool = shutil.which("debootstrap")
        if not tool:
            raise SandboxError("build-image --debootstrap: debootstrap is not installed (apt-get install debootstrap)")
        with tempfile.TemporaryDirectory(dir=m.store.root + "/tmp") as d:
            argv = [tool, "--variant=minbase", a.debootstrap, d] + ([a.mirror] if a.mirror else [])
            if subprocess.run(argv).returncode != 0:
                raise SandboxError(f"build-image: {' '.join(argv)} failed")
            print(import_image(m.store, d))
    else:
        print(default_image(m.store, a.python))
    return 0


def env_main(argv: list[str]) -> int:
    argv, tail = list(argv), None
    if "exec" in argv and "--" in argv[argv.index("exec"):]:  # exec's options end at --, the command follows
        cut = argv.index("--", argv.index("exec"))
        argv, tail = argv[:cut], argv[cut + 1:]
    a = _parser().parse_args(argv)
    m = SandboxManager(a.root)
    if a.cmd == "create":
        return _create(m, a)
    if a.cmd == "exec":
        return _exec(m, a, a.command + (tail or []))
    if a.cmd == "snapshot":
        print(m.get(a.id).snapshot())
    elif a.cmd in ("pause", "resume"):
        getattr(m.get(a.id), a.cmd)()
    elif a.cmd == "fork":
        print(m.fork(a.snapshot, backend=a.backend, name=a.name).id)
    elif a.cmd == "restore":
        m.get(a.id).restore(a.snapshot)
    elif a.cmd == "ls":
        return _ls(m, a)
    elif a.cmd == "rm":
        for i in a.ids:
            if a.snapshot:
                m.remove_snapshot(i)
            else:
                m.remove(i)
    elif a.cmd == "gc":
        print(json.dumps(m.gc()))
    elif a.cmd == "build-image":
        return _build_image(m, a)
    return 0
