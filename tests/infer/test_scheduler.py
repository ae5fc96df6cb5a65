"""The engine's Scheduler on its own: no model, no thread. A plan is executed here by hand the way
the runner does (a chunk moves the request to its ``end``; a finished prompt joins the decode
batch), so each test states what a step should do from the rules, not from the code's constants:
admission by count and bytes, the prefill budget, cuts at cache blocks, equal-length batches, and
a request that could resume from a snapshot of this very step waiting one step for it."""

import pytest

from k3.infer.prefix_cache import PrefixCache
from k3.infer.sampling import SamplingParams
from k3.infer.scheduler import PrefillBatch, PrefillChunk, Request, RequestHandle, Scheduler

from test_prefix_cache import fake_cache   # a batch-1 cache that 'has seen' given tokens (same folder)

_ids = iter(range(10**6))


def req(prompt, reserved=0, **params):
    return Request(RequestHandle(next(_ids), None), list(prompt), SamplingParams(**params), None, None,
                   reserved, 16)


class Rows:
    """Stand-in for the cache rows a finished prefill hands to the decode batch: only its length
    is asked (which decode group accepts it); each has its own, so each starts its own group."""
    _n = iter(range(1, 10**6))

    def __init__(self):
        self.seq_len = next(self._n)


def run(sched: Scheduler, plan) -> list[tuple]:
    """Execute ``plan`` as the runner does, without a model; returns what ran, as tuples."""
    ran = []
    for w in plan.prefill:
        if isinstance(w, PrefillBatch):
            ran.append(("batch", [r.handle.rid for r in w.reqs]))
            for r in w.reqs:
                r.started, r.pos = True, len(r.prompt)
            sched.prefilled(w.reqs, Rows())
            continue
        r = w.req
        if not r.started:    # the runner's prefix lookup: resume from the deepest snapshot
            r.started = True
            hit = sched.prefix.match(r.prompt).length if sched.prefix is not None else 0
            r.pos = hit if 0 < hit < len(r.prompt) else 0
        ran.append(("chunk", r.handle.rid, w.start, w.end))
        assert w.start == r.pos     # the plan starts where the request is
        r.pos = w.end
        if r.pos == len(r.prompt):
            sched.prefilled([r], Rows())
    return ran


def test_admission_by_count_then_by_bytes_in_order():
    s = Scheduler(max_batch=2, prefill_chunk=1000, cache_block=64)
    a, b, c = req([1] * 5), req([2] * 5), req([3] * 5)
    for r in (a, b, c):
        s.add(r)
    assert s.schedule().admitted == [a, b] and list(s.waiting) == [c]
    # bytes: 60 + 50 > 100, so the second waits although a slot is free; a small third behind it
    # waits too (first come, first served)
    s = Scheduler(max_batch=8, prefill_chunk=1000, cache_block=64, max_cache_bytes=100)
    a, b, c = req([1] * 5, reserved=60), req([2] * 5, reserved=50), req([3] * 5, reserved=10)
    for r in (a, b, c):
        s.add(r)
    assert s.schedule().admitted == [a] and list(s.waiting) == [b, c]
    a.finished = True
    run(s, s.schedule())
    s.drop_finished()
    assert s.schedule().admitted == [b, c]     # a's bytes are free once it left


def test_budget_spans_requests_and_steps_and_covers_every_prompt_once():
    s = Scheduler(max_batch=8, prefill_chunk=100, cache_block=64)
    lens = [30, 150, 7, 61]
    reqs = [req(range(n)) for n in lens]
    for r in reqs:
        s.add(r)
    covered = {r.handle.rid: [] for r in reqs}
    steps = 0
    while s.prefilling or s.waiting:
        plan = s.schedule()
        assert plan.prompt_tokens() <= 100
        for w in run(s, plan):
            covered[w[1]].append((w[2], w[3]))
        steps += 1
        assert steps < 10
    for r, n in zip(reqs, lens):   # each prompt run exactly once, in order, without gaps
        spans = covered[r.handle.rid]
        assert spans[0][0] == 0 and spans[-1][1] == n and all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
    assert steps == -(-sum(lens) // 100)     # the budget is used in full every step but the last


def test_prefix_cache_cuts_chunks_at_every_block_boundary():
    s = Scheduler(max_batch=8, prefill_chunk=256, cache_block=64, prefix=PrefixCache(64, 10**9))
    r = req(range(300))
    s.add(r)
    ran = run(s, s.schedule())
    assert [(a, b) for _, _, a, b in ran] == [(0, 64), (64, 128), (128, 192), (192, 256)]
    assert [(a, b) for _, _, a, b in run(s, s.schedule())] == [(256, 300)]
    # control: without the prefix cache nothing needs a snapshot, one chunk per budget
    s = Scheduler(max_batch=8, prefill_chunk=256, cache_block=64)
    r = req(range(300))
    s.add(r)
    assert [(a, b) for _, _, a, b in run(s, s.schedule())] == [(0, 256)]


def test_equal_length_whole_prompts_batch_within_the_budget():
    s = Scheduler(max_batch=8, prefill_chunk=35, cache_block=64)
    a, b, odd, c, d = req([1] * 10), req([2] * 10), req([3] * 12), req([4] * 10), req([5] * 10)
    for r in (a, b, odd, c, d):
        s.add(r)
    # a's length, in queue order, while 10 more tokens fit: a, b, c (40 > 35 leaves d out); the
    # 5 tokens left go to the oldest request not in the batch
    assert run(s, s.schedule()) == [("batch", [a.handle.rid, b.handle.rid, c.handle.rid]),
                                    ("chunk", odd.handle.rid, 0, 5)]
    assert run(s, s.schedule()) == [("chunk", odd.handle.rid, 5, 12), ("chunk", d.handle.rid, 0, 10)]


def test_solo_and_prompt_logprob_requests_never_batch():
    s = Scheduler(max_batch=8, prefill_chunk=100, cache_block=64)
    a, b, scored = req([1] * 10), req([2] * 10), req([3] * 10, prompt_logprobs=0)
    b.solo = scored.solo = True
    for r in (a, b, scored):
        s.add(r)
    ran = run(s, s.schedule())
    assert [w[0] for w in ran] == ["chunk", "chunk", "chunk"]
    # control: the same three without the flags run as one batch
    s = Scheduler(max_batch=8, prefill_chunk=100, cache_block=64)
    rs = [req([k] * 10) for k in (1, 2, 3)]
    for r in rs:
        s.add(r)
    assert run(s, s.schedule()) == [("batch", [r.handle.rid for r in rs])]


@pytest.mark.parametrize("shared", [64, 20])
def test_a_request_that_could_resume_from_this_steps_snapshot_waits_for_it(shared):
    """``later`` shares ``first``'s first block (or, shared=20, all of a short ``first``): planned
    in the same step it would miss the snapshot ``first`` is about to insert; it waits one step.
    An unrelated request behind it is planned in the step (the control)."""
    pc = PrefixCache(64, 10**9)
    s = Scheduler(max_batch=8, prefill_chunk=1000, cache_block=64, prefix=pc)
    first = req(range(100) if shared == 64 else range(20))
    later = req(list(range(shared)) + [999] * 50)
    s.add(first), s.add(later)
    ran = run(s, s.schedule())
    assert {w[1] for w in ran} == {first.handle.rid}            # later deferred, not missed
    for end in sorted({b for *_, b in ran}):                    # what the runner inserts
        if end % 64 == 0 or end == len(first.prompt):
            pc.insert(first.prompt[:end], fake_cache(first.prompt[:end]))
    ran = run(s, s.schedule())
    assert ran[0][1:3] == (later.handle.rid, shared)            # starts from the snapshot

    pc = PrefixCache(64, 10**9)
    s = Scheduler(max_batch=8, prefill_chunk=1000, cache_block=64, prefix=pc)
    first, other = req(range(100) if shared == 64 else range(20)), req([7] * 80)
    s.add(first), s.add(other)
    assert {w[1] for w in run(s, s.schedule())} == {first.handle.rid, other.handle.rid}


def test_cancel_takes_requests_out_of_prefill_and_marks_running_ones():
    s = Scheduler(max_batch=8, prefill_chunk=5, cache_block=64)
    a, b = req([1] * 3), req([2] * 40)
    s.add(a), s.add(b)
    run(s, s.schedule())                     # a runs whole and is running; b is mid-prefill
    assert s.prefilling == [b] and [r for g in s.groups for r in g.reqs] == [a]
    out = s.cancel({a.handle.rid, b.handle.rid})
    assert out == [b, a] and s.prefilling == [] and b.cache is None
    a.finished = True
    s.drop_finished()
    assert s.groups == [] and not s.has_work()
