"""Greedy word wrapping (see the task goal for the rules)."""


def wrap(text, width):
    """-> list of lines, none longer than ``width``."""
    raise NotImplementedError
