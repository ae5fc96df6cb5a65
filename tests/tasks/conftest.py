"""Real namespace sandboxes for the task-family tests: one manager root per session (set as
K3_ENV_HOME, so the CLI and worker processes use it too), and after every test that used one,
nothing may be left of it (no sandbox directory, cgroup, mount or process naming the root)."""

import os
import sys
from pathlib import Path

import pytest

from k3.tasks.verify import Sandboxes

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "env"))
from env_leaks import leftovers  # noqa: E402 - the one leak check, shared with tests/env and tests/rl


@pytest.fixture(scope="session")
def env_root(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("k3env-families"))
    old = os.environ.get("K3_ENV_HOME")
    os.environ["K3_ENV_HOME"] = root
    Sandboxes("namespace", root)  # build the default image once
    yield root
    if old is None:
        os.environ.pop("K3_ENV_HOME", None)
    else:
        os.environ["K3_ENV_HOME"] = old


@pytest.fixture
def sandboxes(env_root):
    s = Sandboxes("namespace", env_root)
    yield s
    mgr = s.manager
    leaked = leftovers(mgr)
    for st in mgr.list():
        try:
            mgr.get(st["id"]).close()
        except Exception:
            pass
    assert not leaked, f"leaked: {leaked}"
