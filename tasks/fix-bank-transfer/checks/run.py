"""Visible checks for bank (python3 checks/run.py; exit 0 = pass)."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import bank  # noqa: E402

fails = []


def expect(name, got, want):
    if got != want:
        fails.append("%s: got %r, want %r" % (name, got, want))


try:
    b = bank.Bank()
    b.open("ann", 1000)
    b.open("bob")
    b.withdraw("ann", 10)
    expect("withdraw", b.balance("ann"), 990)
    try:
        b.withdraw("ann", 991)
        fails.append("overdraw allowed")
    except bank.InsufficientFunds:
        pass
    try:
        b.transfer("ann", "nobody", 100)
        fails.append("transfer to an unknown account allowed")
    except bank.UnknownAccount:
        pass
    expect("atomic transfer", b.balance("ann"), 990)
    b.transfer("ann", "bob", 290)
    expect("balances", [b.balance("ann"), b.balance("bob")], [700, 290])
    b.apply_interest(150)
    expect("interest 1.5%", [b.balance("ann"), b.balance("bob")], [710, 294])
    expect("history", b.history("bob"), [("transfer-in", 290, 290), ("interest", 4, 294)])
except Exception as e:  # noqa: BLE001
    fails.append("raised %s: %s" % (type(e).__name__, e))
print("\n".join(fails) or "all visible checks pass")
sys.exit(1 if fails else 0)
