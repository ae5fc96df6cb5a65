"""Ordering of a dependency graph."""

from .errors import CycleError  # noqa: F401


def order(graph):
    """graph: {node: [nodes it depends on]} -> list of every node, dependencies first.

    See the task goal for the exact contract (smallest order, CycleError.cycle).
    """
    raise NotImplementedError
