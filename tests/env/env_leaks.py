"""What a test may not leave behind: ``leftovers(mgr)`` lists every sandbox directory, cgroup
``k3-<tag>-*``, mount under the manager root and process naming it that is still there;
``clean_up(mgr)`` removes what it can of that after a test that leaked (so one leak neither
cascades into the next test nor outlives the session's temporary root)."""

import glob
import os

from k3.env import SandboxManager
from k3.env.cgroups import detect_layout


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


def clean_up(mgr: SandboxManager) -> None:
    """Close every sandbox of ``mgr`` and remove every half-made one (no state yet), each tried."""
    for s in mgr.list():
        try:
            mgr.get(s["id"]).close()
        except Exception:
            pass
    for sid, _ in mgr.unmade():
        try:
            mgr.remove_unmade(sid)
        except Exception:
            pass
