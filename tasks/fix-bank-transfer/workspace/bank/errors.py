"""Errors of bank."""


class BankError(ValueError):
    """Any refused operation."""


class UnknownAccount(BankError):
    """No account of that name."""


class InsufficientFunds(BankError):
    """The balance does not cover the amount."""
