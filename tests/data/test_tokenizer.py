import random

import pytest

import k3.data.tokenizer as tokmod
from k3.data.corpus import Corpus
from k3.data.tokenizer import EOS_TOKEN, Tokenizer, get_tokenizer, train_tokenizer


def _small_corpus() -> Corpus:
    rnd = random.Random(0)
    words = ["def", "return", "self", "import", "class", "for", "in", "if", "None", "x", "y"]
    train = [" ".join(rnd.choice(words) for _ in range(200)) + "\n" for _ in range(30)]
    return Corpus("toy", [f"t{i}" for i in range(30)], train, ["v0"], ["def f(x): return x\n"])


@pytest.fixture(scope="module")
def tok():
    return train_tokenizer(_small_corpus().documents("train"), vocab_size=320)


def _random_text(rnd: random.Random, n: int) -> str:
    pools = [range(0x20, 0x7F), range(0, 0x20), range(0xA0, 0x300), range(0x4E00, 0x4F00),
             range(0x1F600, 0x1F650), range(0xE000, 0xE010)]
    return "".join(chr(rnd.choice(rnd.choice(pools))) for _ in range(n))


def test_round_trip_is_exact_on_arbitrary_unicode(tok):
    rnd = random.Random(1)
    for n in (0, 1, 7, 100, 1000):
        s = _random_text(rnd, n)
        assert tok.decode(tok.encode(s)) == s
    s = "  leading spaces\r\n\ttabs \x00 nul, café, 世界, 🎉 and \u200b zero width  "
    assert tok.decode(tok.encode(s)) == s


def test_eos_is_id_zero_and_not_injectable_from_data(tok):
    assert tok.eos_token_id == 0 and tok.token_to_id(EOS_TOKEN) == 0
    assert 256 + 8 < tok.vocab_size <= 320  # fewer when the text runs out of pairs to merge
    ids = tok.encode("a <|endoftext|> b")
    assert 0 not in ids and tok.decode(ids) == "a <|endoftext|> b"
    assert tok.encode(EOS_TOKEN, allow_special=True) == [0]
    assert tok.decode([0]) == EOS_TOKEN


def test_bpe_learns_merges_from_training_text(tok):
    # a frequent word of the training text is a single token or close to it; bytes alone give 6
    assert len(tok.encode(" return")) <= 2


def test_save_load_beside_checkpoint(tok, tmp_path):
    p = tok.save(tmp_path)
    assert p == tmp_path / "tokenizer.json"
    back = Tokenizer.load(tmp_path)
    s = "for x in self: return None"
    assert back.encode(s) == tok.encode(s) and back.fingerprint == tok.fingerprint
    with pytest.raises(FileNotFoundError):
        Tokenizer.load(tmp_path / "missing")


def test_cache_keyed_by_corpus_and_vocab(tmp_path, monkeypatch):
    monkeypatch.setenv("K3_CACHE_DIR", str(tmp_path))
    c = _small_corpus()
    t1 = get_tokenizer(c, 300)
    files = list((tmp_path / "tokenizers").glob("*/tokenizer.json"))
    assert len(files) == 1

    def fail(*a, **k):
        raise AssertionError("should have been loaded from the cache")

    monkeypatch.setattr(tokmod, "train_tokenizer", fail)
    assert get_tokenizer(c, 300).fingerprint == t1.fingerprint
    with pytest.raises(AssertionError, match="cache"):
        get_tokenizer(c, 310)  # another vocab size is another key


def test_vocab_too_small_is_rejected():
    with pytest.raises(ValueError, match="vocab_size"):
        train_tokenizer(["abc"], vocab_size=100)


def test_truncated_tokenizer_cache_is_named_and_retrained(tmp_path, monkeypatch):
    from k3.errors import K3Error

    monkeypatch.setenv("K3_CACHE_DIR", str(tmp_path))
    c = _small_corpus()
    t1 = get_tokenizer(c, 300)
    (path,) = list((tmp_path / "tokenizers").glob("*/tokenizer.json"))
    text = path.read_text()
    path.write_text(text[: len(text) // 2])
    with pytest.raises(K3Error, match=f"{path}: not a valid tokenizer file"):
        Tokenizer.load(path)
    with pytest.warns(UserWarning, match=f"cached tokenizer unusable, retraining it: {path}"):
        t2 = get_tokenizer(c, 300)
    assert t2.fingerprint == t1.fingerprint and Tokenizer.load(path).fingerprint == t1.fingerprint
