"""A toy bank: accounts with integer-cent balances, transfers, interest and a history."""

from .bank import Bank
from .errors import BankError, InsufficientFunds, UnknownAccount

__all__ = ["Bank", "BankError", "InsufficientFunds", "UnknownAccount"]
