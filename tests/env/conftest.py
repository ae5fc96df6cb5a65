"""Sandbox fixtures: one manager root per session (the default image is built once), and a leak
check after every test: no sandbox directory, cgroup ``k3-<tag>-*``, mount under the root, or
process mentioning the root may outlive the test."""

import glob
import os

import pytest

from k3.env import SandboxManager
from k3.env.cgroups import detect_layout


@pytest.fixture(scope="session")
def env_root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("k3env"))


def leftovers(mgr: SandboxManager) -> dict:
    """Everything of ``mgr`` still alive on the host (an empty dict = nothing leaked)."""
    out = {}
    sbs = os.listdir(os.path.join(mgr.root, "sandboxes"))
    if sbs:
        out["sandbox dirs"] = sbs
    cgs = [os.path.join(d, n) for d in detect_layout().all_dirs for n in os.listdir(d)
           if n.startswith(f"k3-{mgr.tag}-")]
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
def manager(env_root):
    mgr = SandboxManager(env_root)
    yield mgr
    leaked = leftovers(mgr)
    for s in mgr.list():  # clean up before failing, so one leak does not cascade
        try:
            mgr.get(s["id"]).close()
        except Exception:
            pass
    assert not leaked, f"leaked: {leaked}"


@pytest.fixture
def sandbox(manager):
    sb = manager.create()
    yield sb
    sb.close()
