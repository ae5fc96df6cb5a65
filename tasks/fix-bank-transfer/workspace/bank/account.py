"""One account: a balance and its history of (kind, amount, balance_after)."""


class Account:
    def __init__(self, name, cents=0):
        self.name = name
        self.balance = cents / 100
        self.history = []

    def deposit(self, cents, kind="deposit"):
        self.balance += cents / 100
        self.history.append((kind, cents, int(self.balance * 100)))

    def withdraw(self, cents, kind="withdraw"):
        self.balance -= cents / 100
        self.history.append((kind, cents, int(self.balance * 100)))
