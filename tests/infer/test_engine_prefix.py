"""Engine with the prefix cache: greedy tokens equal the full-forward reference (and the cache-off
engine) for cache_block {16, 64}, resuming at every boundary of a cached prompt; hits counted."""

from __future__ import annotations

import pytest
import torch
from engine_reference import reference_greedy

from k3.infer.engine import Engine
from k3.infer.sampling import SamplingParams

pytestmark = pytest.mark.usefixtures("no_engine_thread_left")

GREEDY = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)


def _ids(n, seed):
    return torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("block", [16, 64])
def test_prefix_hits_at_every_boundary_give_the_reference_tokens(model, block):
    base = _ids(150, 1)
    # share the first k tokens of base, then diverge: every boundary below 150 and the prompt end
    ks = sorted({*range(block, 150, block), *(k + 1 for k in range(block, 150, block)), 150})
    prompts = [base] + [base[:k] + _ids(7, 100 + k) for k in ks] + [base]
    refs = [reference_greedy(model, p, GREEDY.max_tokens) for p in prompts]
    with Engine(model, max_batch=1, prefill_chunk=40, cache_block=block, prefix_cache_bytes=1 << 26) as eng:
        outs = [eng.submit(p, GREEDY).result().token_ids for p in prompts]
        st = eng.stats()
    assert outs == refs
    assert st["prefix_hits"] == len(prompts) - 1 and st["prefix_misses"] == 1
    assert st["prefix_cache_bytes"] > 0
    # each resumed from the deepest snapshot it shares: a block boundary, or base's prompt end (150)
    # when it extends base; base itself again resumes below its last token, at 149 // block
    want_hit_tokens = sum(150 if k == 150 else k // block * block for k in ks) + 149 // block * block
    assert st["prefix_hit_tokens"] == want_hit_tokens
    # the prompt tokens actually run are the total minus those taken from the cache
    assert st["prompt_tokens"] == sum(map(len, prompts)) - st["prefix_hit_tokens"]


def test_prefix_cache_on_and_off_agree_in_a_batch(model):
    base = _ids(100, 2)
    prompts = [base + _ids(n, 50 + n) for n in (1, 9, 30, 3)] + [_ids(20, 3)]
    with Engine(model, max_batch=8, cache_block=16) as off:
        want = [o.token_ids for o in off.generate(prompts, GREEDY)]
    with Engine(model, max_batch=8, cache_block=16, prefix_cache_bytes=1 << 26) as on:
        first = on.submit(base, GREEDY).result()
        got = [o.token_ids for o in on.generate(prompts, GREEDY)]
        st = on.stats()
    assert got == want and first.token_ids == reference_greedy(model, base, GREEDY.max_tokens)
    assert st["prefix_hits"] >= 4
    assert st["active"] == 0 and st["kda_state_bytes"] == 0 and st["mla_latent_bytes"] == 0
