"""Semantic versions: parse, compare, sort (see the task goal for the rules)."""


def parse(text):
    """'1.2.3-rc.1+build.5' -> (major, minor, patch, prerelease identifiers tuple, build string)."""
    raise NotImplementedError


def compare(a, b):
    """-1, 0 or 1 as version text a has lower, equal or higher precedence than b."""
    raise NotImplementedError


def sort_versions(texts):
    """The version texts sorted by precedence, ascending; equal precedence keeps input order."""
    raise NotImplementedError
