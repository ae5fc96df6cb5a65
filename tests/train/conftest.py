"""Shared fixtures of the training tests."""

import pytest


@pytest.fixture(scope="module")
def env(tmp_path_factory, request):
    """(base dir, a small real-Python corpus) per test module, with k3's caches inside base."""
    from test_loop import make_corpus  # same folder (pytest puts it on sys.path)

    base = tmp_path_factory.mktemp(request.module.__name__.removeprefix("test_"))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("K3_CACHE_DIR", str(base / "cache"))
        yield base, make_corpus(base / "data")
