"""Real sandboxes (namespace backend) under one manager root per session, set as K3_ENV_HOME so
worker processes (pool, Ray) and the CLI use it too; after every test nothing may be left of it:
no sandbox directory, cgroup, mount or process that names the root."""

import glob
import os

import pytest

from k3.env.cgroups import detect_layout
from k3.env.manager import SandboxManager
from k3.rl.verify import Sandboxes


@pytest.fixture(scope="session")
def env_root(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("k3env-rl"))
    old = os.environ.get("K3_ENV_HOME")
    os.environ["K3_ENV_HOME"] = root
    Sandboxes("namespace", root)  # build the default image once
    yield root
    if old is None:
        os.environ.pop("K3_ENV_HOME", None)
    else:
        os.environ["K3_ENV_HOME"] = old


def _leftovers(mgr: SandboxManager) -> dict:
    out = {}
    sbs = os.listdir(os.path.join(mgr.root, "sandboxes"))
    if sbs:
        out["sandbox dirs"] = sbs
    cgs = [n for d in detect_layout().all_dirs for n in os.listdir(d) if n.startswith(f"k3-{mgr.tag}-")]
    if cgs:
        out["cgroups"] = cgs
    with open("/proc/self/mountinfo") as f:
        mounts = [line.split()[4] for line in f if mgr.root in line]
    if mounts:
        out["mounts"] = mounts
    procs = []
    for d in glob.glob("/proc/[0-9]*"):
        try:
            with open(d + "/cmdline", "rb") as f:
                if mgr.root.encode() in f.read():
                    procs.append(int(d[6:]))
        except OSError:
            continue
    if procs:
        out["processes"] = procs
    return out


@pytest.fixture
def sandboxes(env_root):
    s = Sandboxes("namespace", env_root)
    yield s
    mgr = s.manager
    leaked = _leftovers(mgr)
    for st in mgr.list():
        try:
            mgr.get(st["id"]).close()
        except Exception:
            pass
    assert not leaked, f"leaked: {leaked}"
