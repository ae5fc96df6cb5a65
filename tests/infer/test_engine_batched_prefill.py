"""Batched prefill: requests waiting together with whole short prompts of one length run as one
[k, n] forward; their greedy tokens equal the full-forward reference, the prefix cache still gets
their snapshots, mixed lengths and long prompts keep their own path, and a failing batched
forward falls back to one request at a time (so an error stays the request's own)."""

from __future__ import annotations

import pytest
import torch
from engine_reference import reference_greedy

from k3.infer.engine import Engine
from k3.infer.sampling import SamplingParams

pytestmark = pytest.mark.usefixtures("no_engine_thread_left")

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


def _ids(n, seed):
    return torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _submit_together(eng, prompts, params=GREEDY):
    """Queue every prompt before the scheduler thread can admit any (it needs the engine's lock,
    a re-entrant one that ``submit`` takes too), so one step sees them all waiting."""
    with eng._cv:
        handles = [eng.submit(p, params) for p in prompts]
    return [h.result() for h in handles]


def test_equal_length_prompts_prefill_as_one_forward_with_the_reference_tokens(model):
    prompts = [_ids(9, s) for s in range(5)] + [_ids(4, 50), _ids(9, 51), _ids(13, 52)]
    refs = [reference_greedy(model, p, GREEDY.max_tokens) for p in prompts]
    with Engine(model, max_batch=8) as eng:
        outs = _submit_together(eng, prompts)
        st = eng.stats()
    assert [o.token_ids for o in outs] == refs
    assert st["max_prefill_batch"] == 6  # the six 9-token prompts; the 4 and 13 alone
    assert st["prompt_tokens"] == sum(map(len, prompts)) and st["active"] == 0


def test_one_at_a_time_is_the_positive_control_of_the_batch_count(model):
    prompts = [_ids(9, s) for s in range(3)]
    with Engine(model, max_batch=8) as eng:
        outs = [eng.submit(p, GREEDY).result() for p in prompts]  # never two waiting at once
        st = eng.stats()
    assert st["max_prefill_batch"] == 1
    assert [o.token_ids for o in outs] == [reference_greedy(model, p, GREEDY.max_tokens) for p in prompts]


def test_batched_prompts_leave_their_snapshots_and_long_prompts_are_not_batched(model):
    short = [_ids(16, s) for s in range(4)]
    longs = [_ids(40, 10 + s) for s in range(2)]  # over cache_block 16: chunked and snapshotted alone
    with Engine(model, max_batch=8, cache_block=16, prefix_cache_bytes=1 << 26) as eng:
        _submit_together(eng, short + longs)
        st = eng.stats()
        assert st["max_prefill_batch"] == 4 and st["prefix_misses"] == 6
        ext = short[2] + _ids(5, 99)  # resumes from short[2]'s end snapshot (depth 16)
        out = eng.submit(ext, GREEDY).result()
        st2 = eng.stats()
    assert st2["prefix_hits"] == 1 and st2["prefix_hit_tokens"] == 16
    assert out.token_ids == reference_greedy(model, ext, GREEDY.max_tokens)


def test_a_failing_batched_forward_is_retried_one_request_at_a_time(model):
    prompts = [_ids(9, s) for s in range(3)]
    refs = [reference_greedy(model, p, GREEDY.max_tokens) for p in prompts]
    calls = []

    class Flaky(torch.nn.Module):
        """The model, except that a prefill over more than one row raises (decode steps, one token
        per row, go through as they are)."""

        def __init__(self, inner):
            super().__init__()
            self.inner, self.config = inner, inner.config
            self.model, self.lm_head = inner.model, inner.lm_head  # the prepared weights read these

        def new_cache(self, b):
            return self.inner.new_cache(b)

        def forward(self, ids, **kw):
            if ids.shape[1] > 1:
                calls.append(ids.shape[0])
                if ids.shape[0] > 1:
                    raise RuntimeError("batched forward failed")
            return self.inner(ids, **kw)

    with Engine(Flaky(model), max_batch=8) as eng:
        outs = _submit_together(eng, prompts)
        st = eng.stats()
    assert calls == [3, 1, 1, 1]  # the batched prefill was tried once, then each prompt alone
    assert [o.token_ids for o in outs] == refs and st["failed"] == 0 and st["max_prefill_batch"] == 1
