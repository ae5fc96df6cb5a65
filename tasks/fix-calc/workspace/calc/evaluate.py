"""Tree -> value."""

from .parser import parse


def _eval(node):
    if node[0] == "num":
        return node[1]
    op, left, right = node
    a, b = _eval(left), _eval(right)
    if op == "+":
        return a + b
    if op == "-":
        return a - b
    if op == "*":
        return a * b
    return a / b


def evaluate(text):
    return _eval(parse(text))
