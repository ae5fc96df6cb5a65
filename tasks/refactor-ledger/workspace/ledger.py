"""Plain-text ledger: one entry per line, 'YYYY-MM-DD  account  amount  [memo]'.

Amounts may have thousands separators (1,234.50) and accounting negatives ((12.00) or -12.00);
blank lines and lines starting with '#' are ignored; account names are case-insensitive.
"""

import re
import sys
from decimal import Decimal

LINE = re.compile(r"^(\d{4}-\d{2}-\d{2})\s+(\S+)\s+(\(?-?[\d,]+(?:\.\d{1,2})?\)?)(?:\s+(.*))?$")


def parse_line(line):
    """-> (date, account, Decimal amount, memo), or None for a blank or comment line."""
    line = line.strip()
    if not line or line.startswith("#"):
        return None
    m = LINE.match(line)
    if not m:
        raise ValueError("bad ledger line: %r" % line)
    date, account, amount, memo = m.groups()
    neg = amount.startswith("(") and amount.endswith(")")
    value = Decimal(amount.strip("()").replace(",", ""))
    return (date, account.lower(), -value if neg else value, (memo or "").strip())


def parse_file(text):
    entries = []
    for i, line in enumerate(text.splitlines(), 1):
        try:
            entry = parse_line(line)
        except ValueError as e:
            raise ValueError("line %d: %s" % (i, e))
        if entry:
            entries.append(entry)
    return entries


def balances(text):
    """{account: total} sorted by account."""
    totals = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = LINE.match(line)
        if not m:
            raise ValueError("bad ledger line: %r" % line)
        amount = m.group(3)
        neg = amount.startswith("(") and amount.endswith(")")
        value = Decimal(amount.strip("()").replace(",", ""))
        account = m.group(2).lower()
        totals[account] = totals.get(account, Decimal(0)) + (-value if neg else value)
    return dict(sorted(totals.items()))


def monthly(text):
    """{"YYYY-MM": {account: total}} sorted by month then account."""
    months = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = LINE.match(line)
        if not m:
            raise ValueError("bad ledger line: %r" % line)
        amount = m.group(3)
        neg = amount.startswith("(") and amount.endswith(")")
        value = Decimal(amount.strip("()").replace(",", ""))
        month = months.setdefault(m.group(1)[:7], {})
        account = m.group(2).lower()
        month[account] = month.get(account, Decimal(0)) + (-value if neg else value)
    return {k: dict(sorted(v.items())) for k, v in sorted(months.items())}


def format_amount(value):
    """Decimal -> '1,234.50', negatives in parentheses: '(1,234.50)'."""
    text = "{:,.2f}".format(abs(value))
    return "(%s)" % text if value < 0 else text


def report(text):
    rows = ["%-20s %14s" % (account, format_amount(total)) for account, total in balances(text).items()]
    rows.append("%-20s %14s" % ("TOTAL", format_amount(sum(balances(text).values(), Decimal(0)))))
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        sys.stdout.write(report(f.read()))
