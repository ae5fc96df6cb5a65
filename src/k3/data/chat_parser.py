"""Streaming parser of one generated assistant message (SPEC §6.3): token ids -> events -> result.

Feed the ids the model generates after the generation prompt (which ends with ``<think>``), one at a
time; each ``feed`` returns the events that id completes:

- ``ReasoningDelta(text)`` / ``ContentDelta(text)``: text decoded incrementally from token bytes
  (a character split across tokens comes out whole, with the token that completes it);
- ``ToolCallBegin(index, id, name)`` once a call's header ``functions.{name}:{i}`` is complete,
  ``ToolCallArgumentsDelta(index, text)`` as its JSON arrives, ``ToolCallEnd(index, valid)``.

A call whose header is not ``functions.{name}:{i}`` or whose arguments are not a JSON object is
not a tool call: its raw text (markers spelled out) comes back as content. Its ``ToolCallEnd`` says
``valid=False`` and its index is reused by the next call, so a consumer that must never show a
retracted call holds a call's deltas until its end. A special token where the format has no place
for it is text of the current channel; an id the tokenizer does not have reads as U+FFFD. Nothing the model writes makes the parser raise.

``finish(reason)`` flushes and returns the ``ChatResult`` (reasoning, content, tool_calls in the
OpenAI schema, finish_reason "tool_calls" | "stop" after ``<|im_end|>``, else ``reason`` or
"length").
"""

from __future__ import annotations

import codecs
import json
import re
from dataclasses import dataclass, field

from k3.errors import K3Error

__all__ = ["TOOL_CALL_ID", "ChatParser", "ChatResult", "ReasoningDelta", "ContentDelta", "ToolCallBegin",
           "ToolCallArgumentsDelta", "ToolCallEnd"]

# a tool call's id as the chat format writes it: functions.NAME:INDEX
TOOL_CALL_ID = re.compile(r"functions\.([A-Za-z0-9_.\-]{1,64}):(\d+)")


@dataclass(frozen=True)
class ReasoningDelta:
    text: str


@dataclass(frozen=True)
class ContentDelta:
    text: str


@dataclass(frozen=True)
class ToolCallBegin:
    index: int
    id: str
    name: str


@dataclass(frozen=True)
class ToolCallArgumentsDelta:
    index: int
    text: str


@dataclass(frozen=True)
class ToolCallEnd:
    index: int
    valid: bool


@dataclass
class ChatResult:
    reasoning: str
    content: str
    tool_calls: list[dict]
    finish_reason: str
    tail_events: list = field(default_factory=list)  # what ``finish`` flushed (still to stream)

    def message(self) -> dict:
        """The OpenAI-style assistant message (what a client sends back in the next turn)."""
        m = {"role": "assistant", "content": self.content, "reasoning_content": self.reasoning}
        if self.tool_calls:
            m["tool_calls"] = self.tool_calls
        return m


def _decoder():
    return codecs.getincrementaldecoder("utf-8")(errors="replace")


class _Call:
    """One tool call being read: its raw bytes (for the content fallback) and its parts."""

    def __init__(self, begin: bytes):
        self.raw = bytearray(begin)
        self.header = bytearray()
        self.args: list[str] = []
        self.args_dec = _decoder()
        self.id: str | None = None
        self.name: str | None = None


class ChatParser:
    """State machine over ids: reasoning -> content -> tool-call section -> end (``<|im_end|>``)."""

    def __init__(self, fmt, in_reasoning: bool = True):
        self.tok = fmt.tok
        self._n_ids = fmt.tok.vocab_size
        ids = fmt.ids
        self._end_ids = {ids["<|im_end|>"], self.tok.eos_token_id}
        self._think_end = ids["</think>"]
        self._sec_begin, self._sec_end = ids["<|tool_calls_section_begin|>"], ids["<|tool_calls_section_end|>"]
        self._call_begin, self._arg_begin = ids["<|tool_call_begin|>"], ids["<|tool_call_argument_begin|>"]
        self._call_end = ids["<|tool_call_end|>"]
        self.state = "reasoning" if in_reasoning else "content"
        self.reasoning_tokens = 0
        self._text = {"reasoning": [], "content": []}
        self._dec = {"reasoning": _decoder(), "content": _decoder()}
        self._call: _Call | None = None
        self.tool_calls: list[dict] = []
        self.ended = False

    @property
    def in_reasoning(self) -> bool:
        """True while the model is thinking (the engine counts these ids against the cap)."""
        return self.state == "reasoning"

    # ------------------------------------------------------------------------------- feed
    def feed(self, token_id: int) -> list:
        if self.ended:
            raise K3Error("the chat parser already finished (<|im_end|> or finish()); "
                          f"token {token_id} has no message to go to")
        # an id past the tokenizer (a model may have more embedding rows) reads as U+FFFD
        b = self.tok.token_bytes(token_id) if 0 <= token_id < self._n_ids else "\ufffd".encode()
        ev: list = []
        if token_id in self._end_ids:
            self._close(ev)
            self.ended = True
            return ev
        st = self.state
        if st in ("reasoning", "content", "section"):
            if token_id == self._think_end and st == "reasoning":
                self._flush("reasoning", ev)
                self.state = "content"
            elif token_id == self._sec_begin and st != "section":
                self._flush(st, ev)
                self.state = "section"
            elif token_id == self._call_begin and st == "section":
                self._call = _Call(b)
                self.state = "header"
            elif token_id == self._sec_end and st == "section":
                self.state = "content"
            else:
                if st == "reasoning":
                    self.reasoning_tokens += 1
                self._add("content" if st == "section" else st, b, ev)
        elif st == "header":
            self._call.raw += b
            if token_id == self._arg_begin:
                self._header_done(ev)
            elif token_id == self._call_end:
                self._call_done(ev)
            else:
                self._call.header += b
        else:  # "args"
            self._call.raw += b
            if token_id == self._call_end:
                self._call_done(ev)
            else:
                self._args(b, ev)
        return ev

    def finish(self, reason: str | None = None) -> ChatResult:
        """Flush what is pending and return the result (call once)."""
        ev: list = []
        ended = self.ended
        if not ended:
            self._close(ev)
            self.ended = True
        if ended:
            finish = "tool_calls" if self.tool_calls else "stop"
        else:
            finish = reason or "length"
        return ChatResult("".join(self._text["reasoning"]), "".join(self._text["content"]),
                          list(self.tool_calls), finish, ev)

    # ---------------------------------------------------------------------------- helpers
    def _add(self, channel: str, b: bytes, ev: list) -> None:
        text = self._dec[channel].decode(b)
        if text:
            self._text[channel].append(text)
            ev.append(ReasoningDelta(text) if channel == "reasoning" else ContentDelta(text))

    def _flush(self, channel: str, ev: list) -> None:
        text = self._dec[channel].decode(b"", final=True)
        if text:
            self._text[channel].append(text)
            ev.append(ReasoningDelta(text) if channel == "reasoning" else ContentDelta(text))

    def _close(self, ev: list) -> None:
        """End of the message: a call still open is not a call (its raw text is content)."""
        if self.state in ("header", "args"):
            self._reject_call(ev)
        for ch in ("reasoning", "content"):
            self._flush(ch, ev)
        self.state = "done"

    def _header_done(self, ev: list) -> None:
        c = self._call
        try:
            header = bytes(c.header).decode("utf-8")
        except UnicodeDecodeError:
            header = ""
        hit = TOOL_CALL_ID.fullmatch(header)
        if hit:
            c.id, c.name = header, hit.group(1)
            ev.append(ToolCallBegin(len(self.tool_calls), c.id, c.name))
        self.state = "args"

    def _args(self, b: bytes, ev: list) -> None:
        c = self._call
        text = c.args_dec.decode(b)
        if text:
            c.args.append(text)
            if c.id is not None:
                ev.append(ToolCallArgumentsDelta(len(self.tool_calls), text))

    def _call_done(self, ev: list) -> None:
        c = self._call
        tail = c.args_dec.decode(b"", final=True)
        if tail:
            c.args.append(tail)
            if c.id is not None:
                ev.append(ToolCallArgumentsDelta(len(self.tool_calls), tail))
        args = "".join(c.args)
        try:
            ok = c.id is not None and isinstance(json.loads(args), dict)
        except (ValueError, RecursionError):
            ok = False
        if not ok:
            self._reject_call(ev)
        else:
            ev.append(ToolCallEnd(len(self.tool_calls), True))
            self.tool_calls.append({"id": c.id, "type": "function",
                                    "function": {"name": c.name, "arguments": args}})
            self._call = None
        self.state = "section"

    def _reject_call(self, ev: list) -> None:
        c = self._call
        if c.id is not None:
            ev.append(ToolCallEnd(len(self.tool_calls), False))
        self._flush("content", ev)
        raw = bytes(c.raw).decode("utf-8", errors="replace")
        self._text["content"].append(raw)
        ev.append(ContentDelta(raw))
        self._call = None
