"""Text -> tokens: ("num", value) and ("op", char)."""

import re

from .errors import CalcError

TOKEN = re.compile(r"\s*(?:(\d+)|(.))")


def tokenize(text):
    tokens = []
    for num, op in TOKEN.findall(text):
        if num:
            tokens.append(("num", int(num)))
        elif op in "+-*/()":
            tokens.append(("op", op))
        elif op.strip():
            raise CalcError("bad character %r" % op)
    return tokens
