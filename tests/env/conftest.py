"""Sandbox fixtures: one manager root per session (the default image is built once), and a leak
check after every test: no sandbox directory, cgroup ``k3-<tag>-*``, mount under the root, or
process mentioning the root may outlive the test."""

import pytest
from env_leaks import clean_up, leftovers

from k3.env import SandboxManager


@pytest.fixture(scope="session")
def env_root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("k3env"))


@pytest.fixture
def manager(env_root):
    mgr = SandboxManager(env_root)
    yield mgr
    leaked = leftovers(mgr)
    clean_up(mgr)   # before failing, so one leak does not cascade
    assert not leaked, f"leaked: {leaked}"


@pytest.fixture
def sandbox(manager):
    sb = manager.create()
    yield sb
    sb.close()
