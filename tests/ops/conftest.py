"""Shared by the ops tests."""

from __future__ import annotations

import pytest
import torch

from k3.ops import cpu_kernels


@pytest.fixture(params=["c", "torch"])
def path(request, monkeypatch):
    """The two CPU forms of an op with a C kernel: the C op, and the torch formulation that runs
    where the kernels cannot be built (forced off here, for every op at once)."""
    if request.param == "torch":
        monkeypatch.setattr(cpu_kernels, "unavailable", lambda: "forced off by the test")
    else:
        assert cpu_kernels.unavailable() is None
    return request.param


@pytest.fixture
def at_1_and_2_threads():
    """``run(fn)`` -> (fn() at 1 thread, fn() at 2 threads); torch's thread count restored after."""
    def run(fn):
        threads = torch.get_num_threads()
        try:
            torch.set_num_threads(1)
            one = fn()
            torch.set_num_threads(2)
            return one, fn()
        finally:
            torch.set_num_threads(threads)
    return run


@pytest.fixture
def autograd_nodes():
    """``names(t)`` -> the type names of every autograd node behind tensor t (to see which op ran)."""
    def names(t):
        seen, todo = [], [t.grad_fn]
        while todo:
            f = todo.pop()
            if f is not None and type(f).__name__ not in seen:
                seen.append(type(f).__name__)
                todo.extend(g for g, _ in f.next_functions)
        return seen
    return names
