"""Split every line of an invoice between people by share, then sum per person."""

from .allocate import allocate


def split_invoice(lines, shares):
    """lines: [(description, cents)]; shares: {person: weight} -> {person: cents}.

    Each line is allocated separately (people in sorted order), so per-person totals add up to
    the invoice total exactly.
    """
    people = sorted(shares)
    totals = dict.fromkeys(people, 0)
    for _desc, cents in lines:
        for person, part in zip(people, allocate(cents, [shares[p] for p in people])):
            totals[person] += part
    return totals
