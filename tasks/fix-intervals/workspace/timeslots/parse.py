"""'HH:MM-HH:MM' -> (start, end) in minutes since midnight."""

import re

SLOT = re.compile(r"(\d\d):(\d\d)-(\d\d):(\d\d)")


def parse_slot(text):
    m = SLOT.fullmatch(text.strip())
    if not m:
        raise ValueError("not a slot: %r" % text)
    h1, m1, h2, m2 = map(int, m.groups())
    return (h1 * 60 + m1, h2 * 60 + m2)
