import numpy as np
import pytest
import torch

from k3.data.corpus import Corpus
from k3.data.packing import IGNORE_INDEX, PackedBatches, build_token_stream, eval_batches, pack_documents, token_dtype
from k3.data.tokenizer import train_tokenizer


def test_pack_documents_puts_eos_after_every_document():
    s = pack_documents([[5, 6], [], [7]], eos_id=0, dtype=np.uint16)
    assert s.tolist() == [5, 6, 0, 0, 7, 0] and s.dtype == np.uint16
    assert token_dtype(4096) == np.uint16 and token_dtype(163840) == np.uint32


def _stream(n=1000):
    return np.arange(n, dtype=np.uint16)


def test_batches_are_shifted_windows_and_seq_len_can_change():
    it = PackedBatches(_stream(), batch_size=2, seq_len=4)
    x, y = it.next_batch()
    assert x.tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert y.tolist() == [[1, 2, 3, 4], [5, 6, 7, 8]]
    x, y = it.next_batch(seq_len=8)
    assert x.shape == (2, 8) and x[0, 0] == 8 and torch.equal(y[:, :-1], x[:, 1:])
    assert x.dtype == torch.long


def test_resume_from_state_dict_reproduces_batches_exactly():
    lens = [16, 32, 8, 16, 64, 32, 16, 8, 64, 64, 32]
    a = PackedBatches(_stream(1000), batch_size=3, seq_len=16)
    for T in lens[:4]:
        a.next_batch(T)
    state = a.state_dict()
    rest_a = [a.next_batch(T) for T in lens[4:]]
    b = PackedBatches(_stream(1000), batch_size=3, seq_len=16)
    b.load_state_dict(dict(state))
    rest_b = [b.next_batch(T) for T in lens[4:]]
    for (xa, ya), (xb, yb) in zip(rest_a, rest_b):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    assert a.state_dict() == b.state_dict() and a.epoch >= 1  # the run wrapped around


def test_load_state_rejects_a_different_layout():
    a = PackedBatches(_stream(), batch_size=2, seq_len=4)
    b = PackedBatches(_stream(), batch_size=3, seq_len=4)
    with pytest.raises(ValueError, match="batch_size"):
        b.load_state_dict(a.state_dict())


def test_ranks_take_disjoint_rows_of_the_global_batch():
    full = PackedBatches(_stream(), batch_size=4, seq_len=5).next_batch()
    parts = [PackedBatches(_stream(), batch_size=2, seq_len=5, rank=r, world_size=2).next_batch()
             for r in range(2)]
    assert torch.equal(torch.cat([p[0] for p in parts]), full[0])
    assert torch.equal(torch.cat([p[1] for p in parts]), full[1])


def test_eval_batches_label_every_token_once():
    s = _stream(23)
    labels, inputs = [], []
    for x, y in eval_batches(s, batch_size=2, seq_len=4):
        keep = y != IGNORE_INDEX
        labels += y[keep].tolist()
        inputs += x[keep].tolist()
    assert labels == list(range(1, 23)) and inputs == list(range(0, 22))


def test_token_stream_is_cached_and_decodes_to_the_documents(tmp_path):
    docs = [f"document number {i} says {'hi ' * i}" for i in range(12)]
    c = Corpus("toy", [f"d{i}" for i in range(10)], docs[:10], ["v0", "v1"], docs[10:])
    tok = train_tokenizer(c.documents("train"), vocab_size=300)
    tr = build_token_stream(c, tok, "train", seed=0, cache=tmp_path)
    va = build_token_stream(c, tok, "validation", cache=tmp_path)
    assert isinstance(tr, np.memmap) and tr.dtype == np.uint16
    assert len(list(tmp_path.glob("*.npy"))) == 2
    split = tok.decode(tr.tolist()).split("<|endoftext|>")
    assert split[-1] == "" and sorted(split[:-1]) == sorted(docs[:10])
    assert split[:-1] != docs[:10]  # training documents are shuffled (seeded)
    assert tok.decode(va.tolist()).split("<|endoftext|>")[:-1] == docs[10:]
    again = build_token_stream(c, tok, "train", seed=0, cache=tmp_path)
    assert np.array_equal(again, tr)


def test_tampered_token_cache_of_the_same_length_is_detected_and_rebuilt(tmp_path):
    docs = [f"def f{i}(x):\n    return x * {i}\n" for i in range(12)]
    c = Corpus("mem", [str(i) for i in range(10)], docs[:10], ["10", "11"], docs[10:])
    tok = train_tokenizer(docs, 300)
    good = np.array(build_token_stream(c, tok, "train", seed=0, cache=tmp_path))
    npy = next(p for p in tmp_path.glob("*.npy") if np.array_equal(np.load(p), good))
    assert (npy.parent / (npy.name + ".sha256")).is_file()
    # positive control: an intact cache is read back as is (no warning)
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert np.array_equal(build_token_stream(c, tok, "train", seed=0, cache=tmp_path), good)
    # same length, other tokens: what a naive length check would accept
    bad = good.copy()
    bad[: len(bad) // 2] = 1
    np.save(npy, bad)
    assert np.load(npy).shape == good.shape
    with pytest.warns(UserWarning, match=f"token cache {npy} does not match its checksum"):
        rebuilt = build_token_stream(c, tok, "train", seed=0, cache=tmp_path)
    assert np.array_equal(rebuilt, good)
    # a cache without its checksum file (written by an older k3, or a crash between the two) too
    (npy.parent / (npy.name + ".sha256")).unlink()
    np.save(npy, bad)
    with pytest.warns(UserWarning, match="has no checksum file"):
        assert np.array_equal(build_token_stream(c, tok, "train", seed=0, cache=tmp_path), good)
