"""SamplingParams validation, the logits processors on hand-made distributions, the per-request
sampler, and the stop-string text stream (stops spanning tokens, split UTF-8)."""

from __future__ import annotations

import math

import pytest
import torch

from k3.errors import K3Error
from k3.infer.detok import TextStream
from k3.infer.sampling import (Sampler, SamplingParams, apply_penalties, min_p_mask, process_logits,
                               top_k_mask, top_p_mask)

P4 = torch.tensor([0.5, 0.3, 0.15, 0.05])
L4 = P4.log()


@pytest.mark.parametrize("field,value", [
    ("max_tokens", 0), ("max_tokens", -3), ("max_tokens", 2.0), ("temperature", -0.1),
    ("temperature", math.nan), ("temperature", math.inf), ("top_k", 0), ("top_p", 0.0), ("top_p", 1.5),
    ("min_p", -0.1), ("min_p", 1.01), ("repetition_penalty", 0.0), ("presence_penalty", math.nan),
    ("frequency_penalty", math.inf), ("stop_token_ids", [-1]), ("stop", [""]), ("seed", 1.5),
    ("logprobs", -1), ("ignore_eos", 1)])
def test_invalid_sampling_values_name_the_field(field, value):
    with pytest.raises(K3Error, match=f"SamplingParams.{field}"):
        SamplingParams(**{field: value})


def test_valid_sampling_values_and_dict_form():
    p = SamplingParams(max_tokens=1, temperature=0, top_k=1, top_p=1.0, min_p=1.0, repetition_penalty=0.5,
                       presence_penalty=-2, frequency_penalty=2, stop_token_ids=[3], stop="x", seed=0,
                       logprobs=0, ignore_eos=True)
    assert p.stop == ("x",) and p.stop_token_ids == (3,) and p.greedy
    assert SamplingParams.from_dict({"max_tokens": 4}).max_tokens == 4
    with pytest.raises(K3Error, match="unknown field.*'max_new_tokens'"):
        SamplingParams.from_dict({"max_new_tokens": 4})


def test_top_k_mask_keeps_the_k_largest_and_ties():
    z = torch.tensor([4.0, 3.0, 2.0, 1.0, 0.0])
    assert top_k_mask(z, 2).tolist() == [True, True, False, False, False]
    assert top_k_mask(z, 9).tolist() == [True] * 5
    assert top_k_mask(torch.tensor([3.0, 2.0, 2.0, 0.0]), 2).tolist() == [True, True, True, False]


def test_top_p_mask_keeps_the_smallest_prefix_reaching_p():
    assert top_p_mask(L4, 0.4).tolist() == [True, False, False, False]  # 0.5 >= 0.4 alone
    assert top_p_mask(L4, 0.75).tolist() == [True, True, False, False]  # 0.5 < 0.75, 0.8 >= 0.75
    assert top_p_mask(L4, 0.85).tolist() == [True, True, True, False]
    assert top_p_mask(L4[[2, 0, 3, 1]], 0.75).tolist() == [False, True, False, True]  # order-free


def test_min_p_mask_is_relative_to_the_top_probability():
    assert min_p_mask(L4, 0.5).tolist() == [True, True, False, False]   # threshold 0.25
    assert min_p_mask(L4, 0.2).tolist() == [True, True, True, False]    # threshold 0.10
    assert min_p_mask(L4, 0.0).tolist() == [True] * 4


def test_penalties_on_a_hand_made_vector():
    z = torch.tensor([2.0, -1.0, 0.5, 3.0])
    seen = torch.tensor([True, True, False, True])
    counts = torch.tensor([0, 2, 0, 1])
    out = apply_penalties(z, seen, counts, repetition=2.0, presence=0.5, frequency=0.25)
    # repetition: 2/2, -1*2, 0.5 untouched (unseen), 3/2; then -0.25*count - 0.5*[count>0]
    assert out.tolist() == pytest.approx([1.0, -2.0 - 0.5 - 0.5, 0.5, 1.5 - 0.25 - 0.5])


def test_process_logits_renormalises_the_kept_tokens():
    probs = process_logits(L4, temperature=1.0, top_k=3).softmax(-1)
    assert probs.tolist() == pytest.approx([0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0.0], abs=1e-6)
    probs = process_logits(L4, temperature=1.0, top_p=0.75, min_p=0.0).softmax(-1)
    assert probs.tolist() == pytest.approx([0.625, 0.375, 0.0, 0.0], abs=1e-6)
    # temperature 0.5 squares the probabilities before renormalising
    want = P4 ** 2 / (P4 ** 2).sum()
    assert process_logits(L4, temperature=0.5).softmax(-1).tolist() == pytest.approx(want.tolist(), abs=1e-6)


def test_draws_follow_the_processed_distribution_and_seeds_repeat():
    s = Sampler(SamplingParams(temperature=1.0, top_k=3, seed=11), 4, [0])
    draws = [s.choose(L4) for _ in range(6000)]
    freq = [draws.count(i) / len(draws) for i in range(4)]
    assert freq == pytest.approx([0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0.0], abs=0.025)
    again = Sampler(SamplingParams(temperature=1.0, top_k=3, seed=11), 4, [0])
    assert [again.choose(L4) for _ in range(200)] == draws[:200]
    other = Sampler(SamplingParams(temperature=1.0, top_k=3, seed=12), 4, [0])
    assert [other.choose(L4) for _ in range(200)] != draws[:200]


def test_greedy_sampler_applies_the_penalties_of_what_it_saw():
    z = torch.tensor([2.0, 1.9, 0.0])
    plain = Sampler(SamplingParams(temperature=0), 3, [0])
    assert plain.choose(z) == 0
    s = Sampler(SamplingParams(temperature=0, repetition_penalty=1.2), 3, [0])  # 0 is in the prompt
    assert s.choose(z) == 1  # 2.0 / 1.2 = 1.67 < 1.9
    f = Sampler(SamplingParams(temperature=0, frequency_penalty=1.0), 3, [2])
    assert f.choose(z) == 0
    f.observe(0)  # output counts only: 2.0 - 1 = 1.0 < 1.9
    assert f.choose(z) == 1


def test_logprobs_under_the_raw_distribution():
    s = Sampler(SamplingParams(temperature=0, logprobs=2), 4, [0])
    lp, top = s.logprobs(L4, 2)
    assert lp == pytest.approx(math.log(0.15), abs=1e-6)
    assert [t for t, _ in top] == [0, 1] and top[1][1] == pytest.approx(math.log(0.3), abs=1e-6)


class PieceTokenizer:
    """A tiny real vocabulary: id -> bytes piece; decode joins bytes, bad UTF-8 shows as U+FFFD."""

    def __init__(self, pieces: list[bytes]):
        self.pieces = pieces

    def decode(self, ids) -> str:
        return b"".join(self.pieces[i] for i in ids).decode("utf-8", errors="replace")


def _run(stream: TextStream, ids: list[int]) -> tuple[str, bool, int]:
    out = []
    for n in range(1, len(ids) + 1):
        delta, stopped = stream.push(ids[:n])
        out.append(delta)
        if stopped:
            return "".join(out), True, n
    return "".join(out) + stream.flush(), False, len(ids)


def test_stop_string_spanning_three_tokens_is_never_emitted():
    tok = PieceTokenizer([b"hel", b"lo E", b"N", b"D tail", b"x"])
    text, stopped, n = _run(TextStream(tok, ("END",)), [0, 1, 2, 3, 4])
    assert (text, stopped, n) == ("hello ", True, 4)
    # each delta is emitted only once it can no longer start the stop string
    s = TextStream(tok, ("END",))
    assert [s.push([0, 1][:k])[0] for k in (1, 2)] == ["hel", "lo "]
    # positive control: without the stop the full text comes out
    assert _run(TextStream(tok, ()), [0, 1, 2, 3, 4]) == ("hello END tailx", False, 5)
    # a near-miss prefix is held, then released when it turns out not to be the stop
    assert _run(TextStream(tok, ("ENDX",)), [0, 1, 2, 3]) == ("hello END tail", False, 4)


def test_earliest_of_several_stops_wins_and_split_utf8_is_held():
    tok = PieceTokenizer([b"ab", b"cd", b"\xc3", b"\xa9!"])
    assert _run(TextStream(tok, ("d", "bc")), [0, 1]) == ("a", True, 2)
    s = TextStream(tok, ())
    assert s.push([0, 2]) == ("ab", False)  # é is half there: nothing of it yet
    assert s.push([0, 2, 3]) == ("\u00e9!", False)
