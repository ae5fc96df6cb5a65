"""The incremental ``TextStream``: after every push its text equals decoding the whole output at
once (random ids of the real byte-level tokenizer, characters split across tokens, a decoder that
drops a leading space, one that rewrites earlier text), with stop strings still cut exactly, and
a push decodes only a few ids whatever the output length."""

from __future__ import annotations

import random

import pytest

from k3.data.tokenizer import train_tokenizer
from k3.infer.detok import TextStream


class Pieces:
    """id -> bytes piece; ``strip``: drop the output's leading space (as SentencePiece decoders
    do); ``tidy``: rewrite " ." as "." (a decoder whose later ids change earlier text). Counts
    the ids it decodes."""

    def __init__(self, pieces: list[bytes], strip=False, tidy=False):
        self.pieces, self.strip, self.tidy, self.decoded = pieces, strip, tidy, 0

    def decode(self, ids) -> str:
        ids = list(ids)
        self.decoded += len(ids)
        text = b"".join(self.pieces[i] for i in ids).decode("utf-8", errors="replace")
        if self.strip and text.startswith(" "):
            text = text[1:]
        return text.replace(" .", ".") if self.tidy else text


def _check_every_push(tok, ids, stops=()):
    s, out = TextStream(tok, stops), []
    for n in range(1, len(ids) + 1):
        delta, stopped = s.push(ids[:n])
        out.append(delta)
        if stopped:
            return "".join(out), True
        assert s.text == tok.decode(ids[:n])  # the whole decode, at every step
    return "".join(out) + s.flush(), False


@pytest.fixture(scope="module")
def tok():
    return train_tokenizer(["héllo wörld, the quick brown fox — jumps over the lazy dog 漢字. " * 20],
                           vocab_size=400)


def test_random_ids_of_the_real_tokenizer_decode_as_a_whole(tok):
    rng = random.Random(0)
    for _ in range(20):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(1, 60))]
        text, stopped = _check_every_push(tok, ids)
        assert not stopped and text == tok.decode(ids)


def test_split_characters_leading_space_and_rewriting_decoders():
    utf = Pieces([b"a", b"\xe6", b"\xbc", b"\xa2", b" b", b"\xc3", b"\xa9"])
    ids = [0, 1, 2, 3, 4, 5, 6, 0, 1, 4, 2, 3]
    assert _check_every_push(utf, ids)[0] == utf.decode(ids)
    sp = Pieces([b" hi", b" there", b" you", b"!"], strip=True)
    assert _check_every_push(sp, [0, 1, 2, 3, 1])[0] == "hi there you! there"
    tidy = Pieces([b"a", b" ", b".", b"b"], tidy=True)
    s = TextStream(tidy)
    for n, ids in enumerate([[0], [0, 1], [0, 1, 2], [0, 1, 2, 3]], 1):
        s.push(ids)
        assert s.text == tidy.decode(ids)


def test_stops_still_cut_exactly(tok):
    ids = tok.encode("the quick brown fox jumps over the lazy dog")
    text, stopped = _check_every_push(tok, ids, stops=("fox j",))
    assert (text, stopped) == ("the quick brown ", True)
    assert _check_every_push(tok, ids, stops=("cat",)) == ("the quick brown fox jumps over the lazy dog", False)


def test_a_push_decodes_a_few_ids_not_the_whole_output():
    tok = Pieces([b"x", b"y ", b"z"])
    ids = [i % 3 for i in range(2000)]
    s = TextStream(tok)
    for n in range(1, len(ids) + 1):
        s.push(ids[:n])
    assert s.text == tok.decode(ids)
    assert tok.decoded - len(ids) < 5 * len(ids)  # the whole-output decode would be ~n²/2 = 2,000,000
