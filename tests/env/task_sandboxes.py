"""The sandbox fixtures of tests that run real tasks (tests/rl, tests/tasks): one namespace manager
root per session, set as K3_ENV_HOME so worker processes (pool, Ray) and the CLI use it too; after
every test that used one, nothing may be left of it: no sandbox directory, cgroup, mount or
process that names the root. ``sandbox_fixtures(prefix)`` returns the two fixtures for a conftest."""

import os

import pytest

from env_leaks import clean_up, leftovers  # same folder: the one leak check, shared with tests/env
from k3.tasks.verify import Sandboxes


def sandbox_fixtures(prefix: str):
    """(env_root, sandboxes) fixtures whose manager root is a temp folder named ``prefix``."""
    @pytest.fixture(scope="session", name="env_root")
    def env_root(tmp_path_factory):
        root = str(tmp_path_factory.mktemp(prefix))
        old = os.environ.get("K3_ENV_HOME")
        os.environ["K3_ENV_HOME"] = root
        Sandboxes("namespace", root)  # build the default image once
        yield root
        if old is None:
            os.environ.pop("K3_ENV_HOME", None)
        else:
            os.environ["K3_ENV_HOME"] = old

    @pytest.fixture(name="sandboxes")
    def sandboxes(env_root):
        s = Sandboxes("namespace", env_root)
        yield s
        mgr = s.manager
        leaked = leftovers(mgr)
        clean_up(mgr)
        assert not leaked, f"leaked: {leaked}"

    return env_root, sandboxes
