"""k3.threads.release_openmp_team and the engine's use of it, checked on the OS's own thread list.

libgomp gives each thread that opens a parallel region a team of workers (at 2 threads: one more
OS thread). An idle team in the thread that built the model makes the engine thread's workers
sleep between parallel regions (k3.threads), so the engine ends the teams of the threads that
hand it work. The facts checked: the worker thread exists (control), goes when released, comes
back with the next parallel region, results unchanged; Engine() and submit() end the caller's
team, and the idle engine ends its own, while it keeps generating the same tokens. Run in a child
process so that the test process's own teams stay as they are.
"""

from __future__ import annotations

import json
import subprocess
import sys

CHILD = r"""
import json, os, time, torch
torch.set_num_threads(2)
from k3.config import get_preset
from k3.infer.engine import Engine
from k3.model.decoder import K3ForCausalLM
from k3.threads import release_openmp_team

def tasks():
    return len(os.listdir("/proc/self/task"))

def settle(want):  # the engine ends its team when it next goes idle: poll (at most 5 s) for that
    for _ in range(100):
        if tasks() == want:
            break
        time.sleep(0.05)
    return tasks()

def work():  # one parallel region over 2 threads (2M elements, far above torch's grain size)
    return float(torch.arange(1 << 21, dtype=torch.float64).mul_(3).sum())

out = {}
torch.manual_seed(0)
model = K3ForCausalLM(get_preset("nano")).eval()
out["work0"] = work(); out["with_team"] = tasks()
out["released"] = release_openmp_team(); out["after_release"] = tasks()
out["work1"] = work(); out["team_back"] = tasks()
eng = Engine(model)
out["after_engine"] = tasks()
params = {"max_tokens": 6, "temperature": 0.0, "ignore_eos": True}
out["tokens0"] = eng.generate([[1, 2, 3, 4, 5]], params)[0].token_ids
out["after_generate"] = settle(out["after_engine"])
work(); out["main_team_again"] = tasks()
out["tokens1"] = eng.generate([[1, 2, 3, 4, 5]], params)[0].token_ids
out["after_submit"] = settle(out["after_generate"])
eng.close()
print(json.dumps(out))
"""


def test_release_ends_the_callers_team_and_the_engine_releases_its_callers():
    r = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=300,
                       env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "2"})
    assert r.returncode == 0, r.stderr[-2000:]
    o = json.loads(r.stdout.strip().splitlines()[-1])
    assert o["released"] is True
    assert o["after_release"] == o["with_team"] - 1            # the worker thread exited
    assert o["team_back"] == o["with_team"]                    # control: the next region rebuilds it
    assert o["work0"] == o["work1"] == 3 * (2 ** 21 - 1) * 2 ** 20
    assert o["after_engine"] == o["with_team"]                 # + engine thread, − the caller's worker
    assert o["after_generate"] == o["after_engine"]            # idle, the engine holds no team either
    # after a generate the main thread's new team (control: it exists) is ended by the next submit
    assert o["main_team_again"] == o["after_generate"] + 1
    assert o["after_submit"] == o["after_generate"]
    assert o["tokens0"] == o["tokens1"] and len(o["tokens0"]) == 6
