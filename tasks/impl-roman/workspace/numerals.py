"""Roman numerals."""


def to_roman(n):
    """int 1..3999 -> canonical Roman numeral."""
    raise NotImplementedError


def from_roman(s):
    """Canonical Roman numeral -> int (exact inverse of to_roman)."""
    raise NotImplementedError
