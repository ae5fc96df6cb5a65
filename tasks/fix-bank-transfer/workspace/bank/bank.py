"""The bank: named accounts and the operations between them."""

from .account import Account
from .errors import BankError, InsufficientFunds, UnknownAccount


class Bank:
    def __init__(self):
        self.accounts = {}

    def open(self, name, cents=0):
        self.accounts[name] = Account(name, cents)

    def _get(self, name):
        return self.accounts[name]

    def deposit(self, name, cents):
        self._get(name).deposit(cents)

    def withdraw(self, name, cents):
        acct = self._get(name)
        if acct.balance < cents:
            raise InsufficientFunds(name)
        acct.withdraw(cents)

    def transfer(self, src, dst, cents):
        self._get(src).withdraw(cents, "transfer-out")
        self._get(dst).deposit(cents, "transfer-in")

    def apply_interest(self, basis_points):
        for acct in self.accounts.values():
            acct.deposit(int(acct.balance * basis_points), "interest")

    def balance(self, name):
        return int(self._get(name).balance * 100)

    def history(self, name):
        return list(self._get(name).history)


__all__ = ["Bank", "BankError"]
