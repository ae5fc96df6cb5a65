"""The one exception type of calc."""


class CalcError(ValueError):
    """A malformed expression or an undefined operation."""
