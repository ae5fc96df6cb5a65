"""The thinking cap (SamplingParams.max_thinking_tokens): at the cap the engine emits </think> itself,
and the answer that follows is the model's own continuation of that (reference: a plain greedy run
on the prompt extended by the capped thinking and </think>)."""

from __future__ import annotations

import pytest

from k3.errors import K3Error
from k3.infer.engine import Engine
from k3.infer.sampling import SamplingParams

THINK_END = 7  # any id of the vocabulary serves as the closing token for the engine


@pytest.fixture(scope="module")
def engine(model):
    with Engine(model) as eng:
        yield eng


def greedy(eng, prompt, n, **kw):
    return eng.submit(prompt, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, **kw)).result().token_ids


@pytest.mark.parametrize("cap", [0, 1, 3])
def test_cap_forces_think_end_then_the_answer_continues(engine, cap):
    prompt = [5, 9, 2, 11]
    free = greedy(engine, prompt, 8)
    assert THINK_END not in free[:cap + 1]  # positive control: the model would not close it itself here
    capped = greedy(engine, prompt, 8, max_thinking_tokens=cap, think_end_id=THINK_END)
    assert capped[:cap] == free[:cap] and capped[cap] == THINK_END
    rest = greedy(engine, prompt + capped[:cap + 1], 8 - cap - 1)
    assert capped[cap + 1:] == rest


def test_no_cap_and_a_cap_not_reached_change_nothing(engine):
    prompt = [5, 9, 2, 11]
    free = greedy(engine, prompt, 6)
    assert greedy(engine, prompt, 6, max_thinking_tokens=6, think_end_id=THINK_END) == free
    # closed by the model before the cap: no second </think> is forced
    closer = free[1]
    after = greedy(engine, prompt, 6, max_thinking_tokens=2, think_end_id=closer)
    assert after == free


def test_cap_validation():
    SamplingParams(max_thinking_tokens=4, think_end_id=3)  # positive control
    with pytest.raises(K3Error, match="think_end_id"):
        SamplingParams(max_thinking_tokens=4)
    with pytest.raises(K3Error, match="max_thinking_tokens"):
        SamplingParams(max_thinking_tokens=-1, think_end_id=3)


def test_think_end_outside_vocab_fails_the_request(engine):
    assert greedy(engine, [1, 2], 1, max_thinking_tokens=1, think_end_id=3)
    with pytest.raises(K3Error, match="think_end_id: 999 outside"):
        greedy(engine, [1, 2], 1, max_thinking_tokens=1, think_end_id=999)
