"""Largest-remainder allocation of integer cents."""


def allocate(total, weights):
    """Split ``total`` cents in proportion to ``weights``; see the task goal for the exact rules."""
    raise NotImplementedError
