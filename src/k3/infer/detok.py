"""Incremental detokenization with stop strings that are never emitted.

``TextStream.push(ids)`` is called with a request's whole output so far and returns the new text
to emit and whether a stop string has appeared. Text is held back while it could still be the
start of a stop string (a stop may span any number of tokens) or while it ends inside a UTF-8
sequence (the decoder shows U+FFFD until the remaining bytes arrive). A found stop string cuts
the text at its first character: neither it nor anything after it is emitted.

Incremental: a push decodes only the ids since the last clean point plus the previous step's
ids as context (``decode(ids[prefix:])`` minus ``decode(ids[prefix:read])``), not the whole
output, so a push costs O(new tokens) instead of O(output) (4,096 tokens: O(n) instead of O(n²)
decoding). The read point advances only when the decoded tail does not end in U+FFFD (no
character split across it). Where the context's text is not a prefix of the longer decode (a
decoder that rewrites earlier text), that push decodes the whole output instead.
"""

from __future__ import annotations

__all__ = ["TextStream"]


class TextStream:
    def __init__(self, tokenizer, stops: tuple[str, ...] = ()):
        self.tokenizer = tokenizer
        self.stops = tuple(stops)
        self.emitted = 0  # characters of the decoded output already handed out
        self.text = ""
        self._prefix = self._read = 0  # ids[prefix:read]: context; text of ids[:read] is committed
        self._committed = ""           # decode(ids[:read])
        self._head = ""                # decode(ids[prefix:read])

    def _decode(self, ids: list[int]) -> str:
        """The text of the whole output ``ids`` (which extends the ids of the previous push)."""
        full = self.tokenizer.decode(ids[self._prefix:])
        if full.startswith(self._head):
            text = self._committed + full[len(self._head):]
        else:  # the context decodes differently inside the longer run: no shortcut this time
            text = self.tokenizer.decode(ids)
        if not text.endswith("\ufffd"):  # a clean point: later pushes decode from here
            self._head = self.tokenizer.decode(ids[self._read:])  # decoded on its own, as next time
            self._committed, self._prefix, self._read = text, self._read, len(ids)
        return text

    def _held_suffix(self, text: str) -> int:
        """Length of the longest tail of ``text[emitted:]`` that is a proper prefix of a stop."""
        best = 0
        room = len(text) - self.emitted
        for s in self.stops:
            for k in range(min(len(s) - 1, room), best, -1):
                if text.endswith(s[:k]):
                    best = k
                    break
        return best

    def push(self, ids: list[int]) -> tuple[str, bool]:
        """(text delta, stopped) after the output ``ids``."""
        if self.tokenizer is None:
            return "", False
        text = self._decode(ids)
        self.text = text
        cut = None
        for s in self.stops:
            i = text.find(s, self.emitted)
            if i >= 0 and (cut is None or i < cut):
                cut = i
        if cut is not None:
            delta, self.emitted = text[self.emitted:cut], cut
            self.text = text[:cut]
            return delta, True
        end = len(text)
        while end > self.emitted and text[end - 1] == "\ufffd":
            end -= 1
        end -= self._held_suffix(text[:end])
        end = max(end, self.emitted)
        delta, self.emitted = text[self.emitted:end], end
        return delta, False

    def flush(self) -> str:
        """The held-back text at the end of a request that did not stop on a string."""
        delta, self.emitted = self.text[self.emitted:], len(self.text)
        return delta
