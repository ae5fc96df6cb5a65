"""A shell command line -> every simple command it would run (for the policy layer, SPEC §7.4).

``parse_shell(src)`` returns a flat list of ``SimpleCommand`` covering the whole line: the parts of
pipelines and lists (``|``, ``|&``, ``;``, ``&``, ``&&``, ``||``, newlines), subshells and groups,
and, parsed recursively, the insides of command substitutions (``$(...)``, backticks, also inside
double quotes and heredocs with an unquoted delimiter) and process substitutions (``<(...)``,
``>(...)``). Each command carries its redirections. Quote removal follows POSIX sh: single quotes
are literal, double quotes keep ``$``/backtick expansion, a backslash escapes the next character.

A word that holds an expansion (``$X``, ``${X}``, ``$(...)``, backticks, arithmetic) is marked
``dynamic``: its value is unknown before run time, so the policy must not treat it as a literal.
Unquoted glob characters mark ``glob``. Constructs this parser does not model (``case``, function
definitions, ``$((...))`` or ``${...}`` holding a command substitution, nesting deeper than
``MAX_DEPTH``, unbalanced quotes or brackets) raise ``ShellParseError``: the policy denies what it
cannot read (fail closed) rather than guessing.

Recursion into ``bash -c`` / ``sh -c`` / ``eval`` strings is done by the policy (it knows which
programs are shells); this module exposes ``parse_shell(src, depth, origin)`` for it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from k3.errors import K3Error

__all__ = ["MAX_DEPTH", "Redirect", "ShellParseError", "SimpleCommand", "Word", "parse_shell"]

MAX_DEPTH = 6
_SEPARATORS = {";", "&", "&&", "||", "|", "|&", "\n", "(", ")", ";;"}
_REDIRECTS = ("<<<", "<<-", "&>>", "<<", ">>", ">|", "<>", ">&", "<&", "&>", "<", ">")
_SKIP_KEYWORDS = {"if", "then", "else", "elif", "do", "while", "until", "!", "{", "time"}
_END_KEYWORDS = {"fi", "done", "}", "esac"}
_GLOB = set("*?[")


class ShellParseError(K3Error):
    """A command line the policy parser cannot read with certainty; the message says where."""


@dataclass
class Word:
    text: str                  # after quote removal; expansions kept as written
    dynamic: bool = False      # holds an expansion whose value is only known at run time
    glob: bool = False         # holds an unquoted * ? [
    quoted: bool = False       # any part was quoted


@dataclass
class Redirect:
    op: str                    # one of _REDIRECTS
    target: Word               # a file, an fd ("1", "-") for >& <&, or a heredoc delimiter
    fd: str = ""               # the explicit fd before the operator ("2" in 2>), "" if none


@dataclass
class SimpleCommand:
    words: list[Word]
    assignments: list[str] = field(default_factory=list)   # VAR=value before the command
    redirects: list[Redirect] = field(default_factory=list)
    origin: str = "line"       # where it came from: line | $(...) | `...` | <(...) | heredoc | bash -c ...

    @property
    def argv(self) -> list[str]:
        return [w.text for w in self.words]


class _Lexer:
    """Turns one source string into tokens: ("word", Word) | ("op", str) | ("redir", (fd, op)).
    Substitutions met on the way are parsed at once into ``self.subs``."""

    def __init__(self, src: str, depth: int):
        self.s, self.i, self.depth = src, 0, depth
        self.tokens: list[tuple[str, object]] = []
        self.subs: list[SimpleCommand] = []
        self.heredocs: list[tuple[str, bool]] = []   # (delimiter, body expands)

    def fail(self, what: str):
        raise ShellParseError(f"shell parse: {what} at offset {self.i} of {self.s[:80]!r}")

    def run(self) -> list[tuple[str, object]]:
        s = self.s
        while self.i < len(s):
            c = s[self.i]
            if c in " \t":
                self.i += 1
            elif c == "\\" and s.startswith("\\\n", self.i):
                self.i += 2
            elif c == "\n":
                self.tokens.append(("op", "\n"))
                self.i += 1
                self._heredoc_bodies()
            elif c == "#":
                while self.i < len(s) and s[self.i] != "\n":
                    self.i += 1
            elif c in ";&|()" or c in "<>":
                self._operator()
            else:
                self._word()
                if self.tokens[-1][0] == "word" and len(self.tokens) > 1 \
                        and self.tokens[-2] in (("redir", ("", "<<")), ("redir", ("", "<<-"))):
                    delim: Word = self.tokens[-1][1]
                    self.heredocs.append((delim.text, not delim.quoted))
        if self.heredocs:
            self.fail("heredoc without its body")
        return self.tokens

    def _operator(self):
        s, i = self.s, self.i
        if s[i] in "<>" and s.startswith("(", i + 1):  # process substitution <(...) >(...)
            inner, self.i = _matching(s, i + 2, "(", ")", self)
            self.subs += parse_shell(inner, self.depth + 1, f"{s[i]}(...)")
            self.tokens.append(("word", Word("/dev/fd/63", dynamic=True)))
            return
        for op in _REDIRECTS:
            if s.startswith(op, i):
                self.tokens.append(("redir", ("", op)))
                self.i += len(op)
                return
        for op in (";;", "&&", "||", "|&", ";", "&", "|", "(", ")"):
            if s.startswith(op, i):
                self.tokens.append(("op", op))
                self.i += len(op)
                return
        self.fail(f"unknown operator {s[i]!r}")  # pragma: no cover - every first char is listed

    def _word(self):
        s = self.s
        start = self.i
        text: list[str] = []
        w = Word("")
        while self.i < len(s):
            c = s[self.i]
            if c in " \t\n;&|()<>":
                break
            if c == "\\":
                if self.i + 1 >= len(s):
                    self.fail("trailing backslash")
                if s[self.i + 1] != "\n":
                    text.append(s[self.i + 1])
                    w.quoted = True
                self.i += 2
            elif c == "'":
                end = s.find("'", self.i + 1)
                if end < 0:
                    self.fail("unterminated single quote")
                text.append(s[self.i + 1:end])
                w.quoted = True
                self.i = end + 1
            elif c == '"':
                self.i += 1
                self._double_quoted(text, w)
                w.quoted = True
            elif c in "$`":
                text.append(self._expansion(w))
            else:
                if c in _GLOB:
                    w.glob = True
                text.append(c)
                self.i += 1
        w.text = "".join(text)
        raw = s[start:self.i]
        if raw.isdigit() and self.i < len(s) and s[self.i] in "<>":   # 2> file: an fd, not a word
            self.tokens.append(("fd", raw))
            return
        self.tokens.append(("word", w))

    def _double_quoted(self, text: list[str], w: Word):
        s = self.s
        while True:
            if self.i >= len(s):
                self.fail("unterminated double quote")
            c = s[self.i]
            if c == '"':
                self.i += 1
                return
            if c == "\\" and self.i + 1 < len(s) and s[self.i + 1] in '$`"\\\n':
                if s[self.i + 1] != "\n":
                    text.append(s[self.i + 1])
                self.i += 2
            elif c in "$`":
                text.append(self._expansion(w))
            else:
                text.append(c)
                self.i += 1

    def _expansion(self, w: Word) -> str:
        """One ``$...`` or backtick expansion starting at ``self.i``; returns its source text."""
        s, i = self.s, self.i
        if s[i] == "`":
            inner, self.i = _backticks(s, i + 1, self)
            self.subs += parse_shell(inner, self.depth + 1, "`...`")
            w.dynamic = True
            return s[i:self.i]
        nxt = s[i + 1] if i + 1 < len(s) else ""
        if s.startswith("$((", i):
            inner, self.i = _matching(s, i + 3, "(", ")", self, need=2)
            if "$(" in inner or "`" in inner:
                self.fail("command substitution inside $((...))")
        elif nxt == "(":
            inner, self.i = _matching(s, i + 2, "(", ")", self)
            self.subs += parse_shell(inner, self.depth + 1, "$(...)")
        elif nxt == "{":
            inner, self.i = _matching(s, i + 2, "{", "}", self)
            if "$(" in inner or "`" in inner:
                self.fail("command substitution inside ${...}")
        elif nxt.isalnum() or nxt == "_":
            j = i + 1
            if nxt.isdigit():
                j += 1
            else:
                while j < len(s) and (s[j].isalnum() or s[j] == "_"):
                    j += 1
            self.i = j
        elif nxt and nxt in "@*#?$!-":
            self.i = i + 2
        else:  # a lone $ is literal
            self.i = i + 1
            return "$"
        w.dynamic = True
        return s[i:self.i]

    def _heredoc_bodies(self):
        s = self.s
        for delim, expands in self.heredocs:
            body: list[str] = []
            while True:
                if self.i >= len(s):
                    self.fail(f"heredoc {delim!r} is not closed")
                end = s.find("\n", self.i)
                end = len(s) if end < 0 else end
                line = s[self.i:end]
                self.i = min(end + 1, len(s))
                if line.lstrip("\t") == delim:
                    break
                body.append(line)
            if expands:
                text = "\n".join(body)
                probe = _Lexer(text, self.depth)
                while probe.i < len(text):
                    if text[probe.i] in "$`":
                        probe._expansion(Word(""))
                    elif text[probe.i] == "\\":
                        probe.i += 2
                    else:
                        probe.i += 1
                for c in probe.subs:
                    c.origin = "heredoc " + c.origin
                self.subs += probe.subs
        self.heredocs = []


def _matching(s: str, i: int, open_: str, close: str, lx: _Lexer, need: int = 1) -> tuple[str, int]:
    """Source between ``i`` and the ``close`` that balances the already-consumed opener(s); skips
    quoted text. Returns (inner, index after the closer(s))."""
    level, j = 1, i
    while j < len(s):
        c = s[j]
        if c == "\\":
            j += 2
            continue
        if c == "'" and open_ == "(":
            k = s.find("'", j + 1)
            if k < 0:
                lx.fail("unterminated single quote")
            j = k + 1
            continue
        if c == '"':
            j += 1
            while j < len(s) and s[j] != '"':
                j += 2 if s[j] == "\\" else 1
            j += 1
            continue
        if c == "`":
            _, j = _backticks(s, j + 1, lx)
            continue
        if c == open_:
            level += 1
        elif c == close:
            level -= 1
            if level == 0:
                if need == 2:
                    if not s.startswith(close, j + 1):
                        lx.fail("unbalanced $((")
                    return s[i:j], j + 2
                return s[i:j], j + 1
        j += 1
    lx.fail(f"unbalanced {open_!r}")


def _backticks(s: str, i: int, lx: _Lexer) -> tuple[str, int]:
    out, j = [], i
    while j < len(s):
        c = s[j]
        if c == "\\" and j + 1 < len(s) and s[j + 1] in "`$\\":
            out.append(s[j + 1])
            j += 2
        elif c == "`":
            return "".join(out), j + 1
        else:
            out.append(c)
            j += 1
    lx.fail("unterminated backtick")


def parse_shell(src: str, depth: int = 0, origin: str = "line") -> list[SimpleCommand]:
    """Every simple command in ``src`` (top level first, then substitutions in the order met)."""
    if depth > MAX_DEPTH:
        raise ShellParseError(f"shell parse: nesting deeper than {MAX_DEPTH} levels")
    lx = _Lexer(src, depth)
    tokens = lx.run()
    out: list[SimpleCommand] = []
    cur = SimpleCommand([], origin=origin)
    pending_fd = ""
    k = 0

    def flush():
        nonlocal cur
        if cur.words or cur.assignments or cur.redirects:
            out.append(cur)
        cur = SimpleCommand([], origin=origin)

    while k < len(tokens):
        kind, val = tokens[k]
        if kind == "op":
            if val == "(" and cur.words:
                raise ShellParseError(f"shell parse: function definitions are not supported ({cur.argv[0]!r})")
            flush()
        elif kind == "fd":
            pending_fd = val
        elif kind == "redir":
            op = val[1]
            if k + 1 >= len(tokens) or tokens[k + 1][0] != "word":
                raise ShellParseError(f"shell parse: {op!r} without a target")
            target = tokens[k + 1][1]
            cur.redirects.append(Redirect(op, target, pending_fd))
            pending_fd = ""
            k += 1
        else:
            w: Word = val
            if not cur.words and _is_assignment(w):
                cur.assignments.append(w.text)
            elif not cur.words and not w.quoted and w.text in _SKIP_KEYWORDS:
                pass
            elif not cur.words and not w.quoted and w.text in _END_KEYWORDS:
                flush()
            elif not cur.words and not w.quoted and w.text in ("case", "function", "select", "coproc"):
                raise ShellParseError(f"shell parse: {w.text!r} is not supported by the policy parser")
            elif not cur.words and not w.quoted and w.text == "for":
                while k + 1 < len(tokens) and not (tokens[k + 1][0] == "op"):
                    k += 1   # the loop header (for NAME in WORDS) runs nothing
            else:
                cur.words.append(w)
        k += 1
    flush()
    return out + lx.subs


def _is_assignment(w: Word) -> bool:
    name, eq, _ = w.text.partition("=")
    return bool(eq) and name.isidentifier() and not w.text.startswith("=")
