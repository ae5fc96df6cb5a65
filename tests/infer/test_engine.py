"""Engine correctness: greedy tokens equal the argmax of a full no-cache forward recomputed every
step, alone and in a batch of 8 mixed lengths, for prefill chunks {7, 64, 512}; seeded sampling
does not depend on the batch companions; stop strings; logprobs."""

from __future__ import annotations

import pytest
import torch
from engine_reference import reference_greedy

from k3.infer.engine import Engine
from k3.infer.sampling import SamplingParams

pytestmark = pytest.mark.usefixtures("no_engine_thread_left")

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def prompts(lengths, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 512, (n,), generator=g).tolist() for n in lengths]


LENGTHS = [3, 17, 1, 40, 9, 64, 2, 25]


@pytest.fixture(scope="module")
def references(model):
    return [reference_greedy(model, p, GREEDY.max_tokens) for p in prompts(LENGTHS)]


def test_greedy_alone_equals_full_forward_argmax(model, references):
    with Engine(model, max_batch=1) as eng:
        for p, ref in zip(prompts(LENGTHS), references):
            out = eng.submit(p, GREEDY).result()
            assert out.token_ids == ref and out.finish_reason == "length"
    assert len({tuple(r) for r in references}) == len(references)  # not a degenerate continuation


def test_batch_of_8_mixed_lengths_equals_batch_1(model, references):
    with Engine(model, max_batch=8) as eng:
        outs = eng.generate(prompts(LENGTHS), GREEDY)
        st = eng.stats()
    assert [o.token_ids for o in outs] == references
    assert st["active"] == 0 and st["generated_tokens"] == 8 * GREEDY.max_tokens
    assert st["max_decode_batch"] == 8  # all eight lengths decoded in one batch at some step
    assert st["prompt_tokens"] == sum(LENGTHS)


@pytest.mark.parametrize("chunk", [7, 64, 512])
def test_prefill_chunk_sizes_give_the_same_tokens(model, chunk):
    ps = prompts([130, 70, 7, 8], seed=3)
    refs = [reference_greedy(model, p, 6) for p in ps]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    with Engine(model, max_batch=4, prefill_chunk=chunk) as eng:
        assert [o.token_ids for o in eng.generate(ps, params)] == refs


def test_same_seed_same_tokens_whatever_the_companions(model):
    p = prompts([11])[0]
    params = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.95, seed=1234, ignore_eos=True)
    with Engine(model, max_batch=1) as eng:
        alone = eng.submit(p, params).result().token_ids
    others = prompts([11, 5, 30, 11, 2, 19, 11], seed=9)
    mixed = [SamplingParams(max_tokens=n, temperature=1.0, seed=s, ignore_eos=True)
             for n, s in zip([20, 3, 9, 16, 1, 30, 7], range(7))]
    with Engine(model, max_batch=8) as eng:
        handles = [eng.submit(q, m) for q, m in zip(others[:3], mixed[:3])]
        mine = eng.submit(p, params)
        handles += [eng.submit(q, m) for q, m in zip(others[3:], mixed[3:])]
        together = mine.result().token_ids
        for h in handles:
            h.result()
    assert together == alone
    with Engine(model, max_batch=1) as eng:  # positive control: another seed gives other tokens
        assert eng.submit(p, SamplingParams(max_tokens=16, temperature=1.0, top_p=0.95, seed=4321,
                                            ignore_eos=True)).result().token_ids != alone


class PieceTokenizer:
    """Every id decodes to a fixed two-letter piece (a real, if small, vocabulary)."""

    def __init__(self, n: int):
        letters = "abcdefghijklmnopqrstuvwxyz"
        self.pieces = [letters[i % 26] + letters[(i // 26) % 26] for i in range(n)]

    def decode(self, ids) -> str:
        return "".join(self.pieces[i] for i in ids)


def test_stop_string_spanning_tokens_ends_the_request_and_is_not_emitted(model):
    tok = PieceTokenizer(512)
    p = prompts([10], seed=5)[0]
    free_ids = reference_greedy(model, p, 12)
    free = "".join(tok.pieces[i] for i in free_ids)
    stop = free[9:12]  # last letter of token 4, both letters of token 5
    first = free.find(stop)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, stop=[stop])
    with Engine(model, tokenizer=tok) as eng:
        out = eng.submit(p, params).result()
        control = eng.submit(p, GREEDY).result()
    assert out.text == free[:first] and out.finish_reason == "stop"
    assert out.token_ids == free_ids[: (first + len(stop) + 1) // 2]
    assert control.text == free and control.token_ids == free_ids


def test_stop_token_and_eos(model):
    p = prompts([6], seed=2)[0]
    free = reference_greedy(model, p, 10)
    with Engine(model) as eng:
        out = eng.submit(p, SamplingParams(max_tokens=10, temperature=0, stop_token_ids=[free[4]],
                                           ignore_eos=True)).result()
        assert out.token_ids == free[: free.index(free[4]) + 1] and out.finish_reason == "stop"
        model.config.eos_token_id, old = free[2], model.config.eos_token_id
        try:
            eos = eng.submit(p, SamplingParams(max_tokens=10, temperature=0)).result()
            ign = eng.submit(p, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)).result()
        finally:
            model.config.eos_token_id = old
    assert eos.token_ids == free[: free.index(free[2]) + 1] and ign.token_ids == free


def test_logprobs_match_the_full_forward(model):
    p = prompts([8], seed=7)[0]
    with Engine(model) as eng:
        h = eng.submit(p, SamplingParams(max_tokens=4, temperature=0, logprobs=3, ignore_eos=True))
        events = list(h)
    ids = torch.tensor([p + [e.token_id for e in events]])
    with torch.no_grad():
        lp = model(ids).logits[0, len(p) - 1: -1].float().log_softmax(-1)
    for i, e in enumerate(events):
        assert e.logprob == pytest.approx(float(lp[i, e.token_id]), abs=1e-4)
        assert [t for t, _ in e.top_logprobs] == lp[i].topk(3).indices.tolist()


class _WatchedQueue:
    """A handle's queue that records how many events were waiting at each of the reader's gets."""

    def __init__(self, q):
        self.q, self.seen = q, []

    def put(self, ev):
        self.q.put(ev)

    def get(self, *a, **k):
        self.seen.append(self.q.qsize())
        return self.q.get(*a, **k)

    def __getattr__(self, name):
        return getattr(self.q, name)


def test_result_sleeps_until_the_end_while_iteration_streams(model):
    """``result()`` waits for the request's end, not for each token (a waiting caller must not take
    the CPU from the engine's step once per token); iterating (the control) reads tokens as they come."""
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    with Engine(model) as eng:
        h = eng.submit(prompts([5])[0], params)
        h._q = watched = _WatchedQueue(h._q)
        out = h.result()
        assert len(out.token_ids) == 40
        assert watched.seen[0] == 41                 # the 40 events and the end were all there at the first get
        h2 = eng.submit(prompts([5])[0], params)
        h2._q = streamed = _WatchedQueue(h2._q)
        assert [ev.token_id for ev in h2] == out.token_ids
        assert min(streamed.seen) < 41               # the control: iteration got tokens before the end
