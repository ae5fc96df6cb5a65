import random

import pytest

import k3.data.tokenizer as tokmod
from k3.data.corpus import Corpus
from k3.data.tokenizer import EOS_TOKEN, Tokenizer, get_tokenizer, train_tokenizer
from k3.errors import K3Error


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
    assert 256 + 14 < tok.vocab_size <= 320  # fewer when the text runs out of pairs to merge
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


CHAT_STRINGS = ["<|im_system|>", "<|im_user|>", "<|im_assistant|>", "<|im_middle|>", "<|im_end|>",
                "<think>", "</think>", "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>",
                "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>",
                "<|media_placeholder|>"]  # SPEC §6.3, written out here


def test_chat_tokens_have_ids_one_to_thirteen_stored_in_the_file(tok, tmp_path):
    assert [tok.token_to_id(s) for s in CHAT_STRINGS] == list(range(1, 14))
    back = Tokenizer.load(tok.save(tmp_path))
    assert back.chat_token_ids == dict(zip(CHAT_STRINGS, range(1, 14)))
    assert back.missing_chat_tokens == ()


def test_literal_chat_token_text_encodes_as_ordinary_bytes(tok):
    specials = set(range(14))
    for s in CHAT_STRINGS:
        text = f"see {s} here"
        ids = tok.encode(text)
        assert not specials & set(ids) and tok.decode(ids) == text
        assert len(ids) > 3  # spelled out in byte tokens
        # positive control: a template that means the token gets its id
        assert tok.encode(s, allow_special=True) == [tok.token_to_id(s)]
        assert tok.token_to_id(s) in tok.encode(text, allow_special=True)
    assert not specials & set(tok.encode_batch(["<|im_end|><think>"])[0])


def test_old_tokenizer_file_without_chat_tokens_loads(tmp_path):
    old = ["<|endoftext|>", "<|im_system|>", "<|im_user|>", "<|im_assistant|>", "<|im_middle|>",
           "<|im_end|>", "<think>", "</think>"]  # what k3 trained before the tool-call tokens
    path = train_tokenizer(_small_corpus().documents("train"), 300, old).save(tmp_path)
    back = Tokenizer.load(path)
    assert back.eos_token_id == 0 and back.decode(back.encode("for x")) == "for x"
    assert back.chat_token_ids is None
    assert "<|tool_calls_section_begin|>" in back.missing_chat_tokens
    assert "<|im_end|>" not in back.missing_chat_tokens


def test_token_bytes_spell_the_utf8_of_the_text(tok):
    rnd = random.Random(3)
    for n in (1, 10, 300):
        s = _random_text(rnd, n)
        assert b"".join(tok.token_bytes(i) for i in tok.encode(s)) == s.encode("utf-8")
    assert tok.token_bytes(5) == b"<|im_end|>"
    assert tok.token_bytes(tok.vocab_size - 1)  # positive control beside the refusal
    with pytest.raises(K3Error, match="token id"):
        tok.token_bytes(tok.vocab_size)


def test_cache_key_changes_with_the_special_tokens(tmp_path, monkeypatch):
    monkeypatch.setenv("K3_CACHE_DIR", str(tmp_path))
    c = _small_corpus()
    old = ["<|endoftext|>", "<|im_end|>"]
    t_old = get_tokenizer(c, 300, old)
    t_new = get_tokenizer(c, 300)
    assert len(list((tmp_path / "tokenizers").glob("*/tokenizer.json"))) == 2
    assert t_old.chat_token_ids is None and t_new.chat_token_ids is not None
    assert get_tokenizer(c, 300).fingerprint == t_new.fingerprint  # the new one is cached


def test_tokenizer_cached_by_older_k3_is_not_reused(tmp_path, monkeypatch):
    # Where k3 before the chat tokens cached it: key = sha256("1\0{corpus}\0{vocab}\0{specials}")
    import hashlib

    monkeypatch.setenv("K3_CACHE_DIR", str(tmp_path))
    c = _small_corpus()
    old = ["<|endoftext|>", "<|im_system|>", "<|im_user|>", "<|im_assistant|>", "<|im_middle|>",
           "<|im_end|>", "<think>", "</think>"]
    old_key = hashlib.sha256(f"1\0{c.fingerprint}\0300\0{chr(0).join(old)}".encode()).hexdigest()[:24]
    old_file = tmp_path / "tokenizers" / old_key / "tokenizer.json"
    old_file.parent.mkdir(parents=True)
    train_tokenizer(c.documents("train"), 300, old).save(old_file)
    new = get_tokenizer(c, 300)
    assert new.chat_token_ids is not None
    assert len(list((tmp_path / "tokenizers").glob("*/tokenizer.json"))) == 2
    assert Tokenizer.load(old_file).chat_token_ids is None  # still there, untouched
