"""Tokens -> tree: ("num", v) or (op, left, right)."""

from .errors import CalcError
from .lexer import tokenize


class Parser:
    def __init__(self, tokens):
        self.tokens = tokens
        self.pos = 0

    def peek(self):
        return self.tokens[self.pos] if self.pos < len(self.tokens) else None

    def take(self):
        tok = self.tokens[self.pos]
        self.pos += 1
        return tok

    def expr(self):
        left = self.term()
        if self.peek() in (("op", "+"), ("op", "-")):
            op = self.take()[1]
            return (op, left, self.expr())
        return left

    def term(self):
        left = self.factor()
        if self.peek() in (("op", "*"), ("op", "/")):
            op = self.take()[1]
            return (op, left, self.term())
        return left

    def factor(self):
        tok = self.take()
        if tok[0] == "num":
            return ("num", tok[1])
        if tok == ("op", "("):
            node = self.expr()
            self.take()
            return node
        raise CalcError("unexpected %r" % (tok,))


def parse(text):
    return Parser(tokenize(text)).expr()
