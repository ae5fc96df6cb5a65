"""SFT data (k3.data.sft): loss masks from text spans, packing without leakage, bad rows, resume."""

import json

import pytest
import torch

from k3.data.packing import IGNORE_INDEX
from k3.data.sft import ChatData, SFTError, pack_rows
from k3.data.tokenizer import train_tokenizer
from k3.errors import ConfigError

TEXT = ("You are K3. What is 12 + 30? Let me add: 2 + 0 = 2, 1 + 3 = 4, so 42. The answer is 42. "
        "Count the lines: grep -c ERROR data.txt gives 3 lines. def f(x): return x + 1\n") * 30
SHELL = {"type": "function", "function": {"name": "shell", "description": "Run a command",
                                          "parameters": {"type": "object", "properties": {}}}}
START, END = "<|im_assistant|>assistant<|im_middle|><think>", "<|im_end|>"


@pytest.fixture(scope="module")
def tok():
    return train_tokenizer([TEXT], vocab_size=400)


def chats():
    return [
        {"messages": [{"role": "system", "content": "You are K3."},
                      {"role": "user", "content": "What is 12 + 30?"},
                      {"role": "assistant", "reasoning_content": "2 + 0 = 2, 1 + 3 = 4", "content": "42"}],
         "reasoning_effort": "high"},
        {"messages": [{"role": "user", "content": "Count the lines with ERROR."},
                      {"role": "assistant", "reasoning_content": "grep it",
                       "tool_calls": [{"id": "c1", "type": "function",
                                       "function": {"name": "shell", "arguments": '{"cmd": "grep -c ERROR data.txt"}'}}]},
                      {"role": "tool", "tool_call_id": "c1", "content": "3"},
                      {"role": "assistant", "reasoning_content": "3 lines", "content": "The answer is 3."}],
         "tools": [SHELL]},
        {"messages": [{"role": "user", "content": "def f(x)?"},
                      {"role": "assistant", "content": "def f(x): return x + 1"}]},
    ]


def write(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def expected_mask(tok, ids):
    """Independent of the renderer's mask: decode the ids, find each assistant body in the text
    (after the generation prompt up to and including <|im_end|>), and mark the tokens inside."""
    pieces = [tok.decode([i]) for i in ids]
    text = "".join(pieces)
    spans, at = [], 0
    while (s := text.find(START, at)) >= 0:
        b = s + len(START)
        e = text.index(END, b) + len(END)
        spans.append((b, e))
        at = e
    mask, pos = [], 0
    for p in pieces:
        mask.append(int(any(b <= pos and pos + len(p) <= e for b, e in spans)))
        pos += len(p)
    return mask


def test_masks_equal_the_assistant_text_spans(tmp_path, tok):
    data = ChatData(write(tmp_path / "a.jsonl", chats()), tok, seq_len=512, val_percent=0)
    assert len(data.train) == 3
    for conv in data.train:
        want = expected_mask(tok, conv.ids)
        assert conv.mask == want
        assert 0 < sum(want) < len(want)
        # system, user and tool-result text is never trained; assistant text always is
        text_trained = "".join(tok.decode([i]) for i, m in zip(conv.ids, conv.mask) if m)
        for needle in ("You are K3", "What is 12", "Count the lines", "Result of"):
            assert needle not in text_trained
    trained = "".join(tok.decode([i]) for i, m in zip(data.train[1].ids, data.train[1].mask) if m)
    assert "grep it" in trained and "The answer is 3." in trained and "grep -c ERROR" in trained


def test_packed_rows_label_only_trained_tokens_of_the_same_conversation(tmp_path, tok):
    data = ChatData(write(tmp_path / "a.jsonl", chats() * 4), tok, seq_len=256, val_percent=0)
    batches = data.batches(batch_size=2, seed=0)
    x, y, d = batches.next_batch()
    assert x.shape == y.shape == d.shape == (2, 256)
    by_ids = {tuple(c.ids): c for c in data.train}
    for r in range(2):
        docs = d[r].tolist()
        s = 0
        while s < 256:
            e = s
            while e < 256 and docs[e] == docs[s]:
                e += 1
            seg = tuple(x[r, s:e].tolist())
            if seg in by_ids:  # a conversation: labels = next token where that token carries loss
                c = by_ids[seg]
                for t in range(s, e):
                    nxt = t + 1 - s
                    want = c.ids[nxt] if nxt < len(c.ids) and c.mask[nxt] else IGNORE_INDEX
                    assert y[r, t].item() == want
            else:  # padding at the end of the row
                assert e == 256 and (x[r, s:] == 0).all() and (y[r, s:] == IGNORE_INDEX).all()
            s = e
    # more than one conversation shares a row (packing happened)
    assert len(set(d[0].tolist())) > 2


def test_packing_fills_rows_in_order_and_never_splits_a_conversation(tmp_path, tok):
    data = ChatData(write(tmp_path / "a.jsonl", chats() * 5), tok, seq_len=200, val_percent=0)
    rows = pack_rows(data.train, 200)
    assert [c for row in rows for c in row] == data.train
    assert all(sum(len(c.ids) for c in row) <= 200 for row in rows)


def test_batches_resume_exactly(tmp_path, tok):
    data = ChatData(write(tmp_path / "a.jsonl", chats() * 6), tok, seq_len=128, val_percent=0)
    a = data.batches(2, seed=3)
    for _ in range(5):
        a.next_batch()
    state = a.state_dict()
    want = [a.next_batch() for _ in range(6)]   # crosses an epoch boundary
    b = data.batches(2, seed=3)
    b.load_state_dict(state)
    for w, g in zip(want, (b.next_batch() for _ in range(6))):
        assert all(torch.equal(p, q) for p, q in zip(w, g))
    assert b.epoch >= 1
    c = data.batches(3, seed=3)
    with pytest.raises(ValueError, match="batch_size"):
        c.load_state_dict(state)


def test_epochs_reshuffle_by_seed(tmp_path, tok):
    data = ChatData(write(tmp_path / "a.jsonl", chats() * 6), tok, seq_len=128, val_percent=0)
    a, b = data.batches(1, seed=0), data.batches(1, seed=1)
    first_a = [a.next_batch()[0] for _ in range(a.rows_per_epoch())]
    first_b = [b.next_batch()[0] for _ in range(b.rows_per_epoch())]
    assert any(not torch.equal(p, q) for p, q in zip(first_a, first_b))


@pytest.mark.parametrize("row, match", [
    ("{not json", "not a JSON object"),
    ('["a"]', "must be a JSON object"),
    ({"messages": []}, "messages must be a non-empty list"),
    ({"messages": [{"role": "user", "content": "hi"}]}, "no assistant message"),
    ({"messages": [{"role": "assistant", "content": 3}]}, r"messages\[0\]\.content"),
    ({"messages": [{"role": "robot", "content": "x"}]}, r"messages\[0\]\.role"),
    ({"messages": [{"role": "assistant", "content": "x"}], "reasoning_effort": "huge"}, "reasoning_effort"),
    ({"messages": [{"role": "assistant", "content": "x"}], "extra": 1}, "unknown field 'extra'"),
    ({"messages": [{"role": "tool", "tool_call_id": "nope", "content": "x"},
                   {"role": "assistant", "content": "x"}]}, "tool_call_id"),
])
def test_bad_rows_name_file_line_and_field(tmp_path, tok, row, match):
    f = write(tmp_path / "bad.jsonl", [chats()[0], row])
    with pytest.raises(SFTError, match=match) as e:
        ChatData(f, tok, seq_len=512, val_percent=0)
    assert f"{f}:2" in str(e.value)
    # positive control: --skip-bad keeps the good row and counts the bad one
    data = ChatData(f, tok, seq_len=512, val_percent=0, skip_bad=True)
    assert len(data.train) == 1 and len(data.bad) == 1 and f"{f}:2" in data.bad[0]


def test_directory_truncation_and_split(tmp_path, tok):
    d = tmp_path / "dir"
    d.mkdir()
    write(d / "b.jsonl", chats())
    write(d / "a.jsonl", chats()[:1])
    data = ChatData(d, tok, seq_len=512, val_percent=0)
    assert [c.where.rsplit("/", 1)[1] for c in data.train] == ["a.jsonl:1", "b.jsonl:1", "b.jsonl:2", "b.jsonl:3"]
    short = ChatData(d, tok, seq_len=24, val_percent=0)
    assert short.truncated + short.dropped > 0 and all(len(c.ids) <= 24 for c in short.train)
    split = ChatData(write(tmp_path / "many.jsonl", [
        {"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]}
        for i in range(200)]), tok, seq_len=64, val_percent=10)
    assert 5 <= len(split.validation) <= 40 and len(split.train) + len(split.validation) == 200
    with pytest.raises(ConfigError, match="no such file"):
        ChatData(tmp_path / "missing.jsonl", tok, seq_len=64)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="no .jsonl"):
        ChatData(tmp_path / "empty", tok, seq_len=64)
