"""``DecodeStep`` (the engine's decode path: fused projections, no-sort MoE slots, pure [B, H]
rows) against the model's own ``model(tokens, cache)``: logits within 1e-5 of their scale and the
same argmax, step after step, at
batch 1 (few MoE slots: the per-slot path) and at a batch of mixed lengths whose slots cover every
expert (the sorted path), caches left equal; the engine's greedy tokens identical with it on and off
and equal to the full-forward greedy reference; what it refuses falls back to ``model(...)``."""

from __future__ import annotations

import pytest
import torch

from engine_reference import reference_greedy
from k3.infer.decode_step import DecodeStep
from k3.infer.engine import Engine
from k3.infer.sampling import SamplingParams
from k3.model.cache import K3Cache, KDAState

pytestmark = pytest.mark.usefixtures("no_engine_thread_left")


def _prefilled(model, lengths: list[int], seed: int) -> K3Cache:
    g = torch.Generator().manual_seed(seed)
    caches = []
    for n in lengths:
        c = model.new_cache(1)
        model(torch.randint(0, model.config.vocab_size, (1, n), generator=g), cache=c)
        caches.append(c)
    return K3Cache.cat(caches)


def _same_state(a: K3Cache, b: K3Cache) -> None:
    assert torch.equal(a.seq_lens, b.seq_lens)
    for x, y in zip(a.layers, b.layers):
        if isinstance(x, KDAState):
            torch.testing.assert_close(x.conv, y.conv, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(x.recurrent, y.recurrent, rtol=1e-5, atol=1e-5)
        else:
            assert torch.equal(x.lengths, y.lengths)
            torch.testing.assert_close(x.c, y.c, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(x.k_pe, y.k_pe, rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def mixing_model(model):
    """The nano model with non-zero AttnRes pseudo-queries (their init is 0: a uniform mix)."""
    import copy

    m = copy.deepcopy(model)
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith("_res_proj.weight"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return m


@pytest.mark.parametrize("prepared", [True, False])   # k3.infer.decode_fast / the modules' decode paths
@pytest.mark.parametrize("lengths", [[9], [3, 17, 8, 30]])
@torch.no_grad()
def test_decode_step_matches_the_model_forward(mixing_model, lengths, prepared):
    model = mixing_model
    moe = model.moe_layers()[0]
    few_slots = len(lengths) * moe.top_k < moe.num_experts
    assert few_slots == (len(lengths) == 1)  # the MoE with some experts untouched, and with every one
    ref, mine = _prefilled(model, lengths, 0), _prefilled(model, lengths, 0)
    step = DecodeStep(model, prepared=prepared)
    assert DecodeStep.unsupported(model) is None and DecodeStep.accepts(mine)
    tok = torch.randint(0, model.config.vocab_size, (len(lengths),), generator=torch.Generator().manual_seed(1))
    for _ in range(6):
        want = model(tok[:, None], cache=ref, logits_to_keep=1).logits[:, -1]
        got = step.step(tok, mine)
        assert (step._plan is not None) == prepared
        # float rounding only (fused matmuls, the folded AttnRes mix): 1e-5 of the logits' scale
        assert (got - want).abs().max() <= 1e-5 * want.abs().max()
        assert torch.equal(got.argmax(-1), want.argmax(-1))
        tok = want.argmax(-1)
    _same_state(ref, mine)


def test_engine_greedy_tokens_same_with_fast_decode_on_and_off(model):
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, model.config.vocab_size, (n,), generator=g).tolist() for n in (5, 12, 1, 33)]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    with Engine(model, max_batch=4) as on, Engine(model, max_batch=4, fast_decode=False) as off:
        a = [o.token_ids for o in on.generate(prompts, params)]
        b = [o.token_ids for o in off.generate(prompts, params)]
    assert a == b
    assert a == [reference_greedy(model, p, 12) for p in prompts]


def test_what_the_step_refuses_is_named_and_the_engine_falls_back(model):
    assert DecodeStep.unsupported(model) is None  # control
    mla = next(l.self_attn for l in model.model.layers if not l.is_kda)
    mla.record_max_logits = True
    try:
        assert "record_max_logits" in DecodeStep.unsupported(model)
        prompt = [3, 1, 4, 1, 5]
        with Engine(model, max_batch=1) as eng:  # falls back to model(...): still the right tokens
            out = eng.generate([prompt], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
        assert out[0].token_ids == reference_greedy(model, prompt, 6)
    finally:
        mla.record_max_logits = False
    assert not DecodeStep.accepts(model.new_cache(1))  # a fresh cache: nothing to decode from yet


@torch.no_grad()
def test_attn_res_rows_mix_equals_the_training_mix_with_a_nonzero_query():
    from k3.ops.attn_res import attn_res_mix, attn_res_mix_rows

    g = torch.Generator().manual_seed(3)
    for n in (1, 2, 5):
        srcs = [torch.randn(3, 64, generator=g) * (i + 1) for i in range(n)]
        q, gamma = torch.randn(64, generator=g), torch.rand(64, generator=g) + 0.5
        want = attn_res_mix(srcs, q[None], gamma, 1e-5)
        torch.testing.assert_close(attn_res_mix_rows(srcs, q[None], gamma, 1e-5), want, rtol=1e-5, atol=1e-5)
    alpha = torch.softmax(torch.stack([(s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-5) * gamma) @ q
                                       for s in srcs]), 0)  # by hand: the n = 5 case
    assert not torch.allclose(alpha, torch.full_like(alpha, 1 / 5))  # a real, non-uniform mix
    torch.testing.assert_close(attn_res_mix_rows(srcs, q, gamma, 1e-5), sum(a[:, None] * s for a, s in zip(alpha, srcs)),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("prepared", [True, False])
def test_the_cache_after_steps_is_ordinary_and_a_forward_with_autograd_continues_it(model, prepared):
    # The step's math runs in inference mode; the cache and logits it leaves must be ordinary
    # tensors: a later forward with autograd from that cache, and an in-place op on the logits,
    # work (an inference tensor would refuse both), with the same values as the no-grad forward.
    cache = _prefilled(model, [5, 11], 2)
    step = DecodeStep(model, prepared=prepared)
    tok = torch.tensor([3, 7])
    for _ in range(3):
        logits = step.step(tok, cache)
        tok = logits.argmax(-1)
    assert not logits.is_inference()
    logits.div_(2.0)                                                  # in place outside inference mode
    for s in cache.layers:
        for t in ((s.conv, s.recurrent) if isinstance(s, KDAState) else (s.c, s.k_pe)):
            assert not t.is_inference()
    with torch.no_grad():
        want = model(tok[:, None], cache=cache.clone(), logits_to_keep=1).logits      # control
    out = model(tok[:, None], cache=cache, logits_to_keep=1).logits
    out.sum().backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    model.zero_grad(set_to_none=True)
    assert grads and all(torch.isfinite(g).all() for g in grads)
    # The autograd forward runs other kernels than the no-grad one (saved tensors, the C ops' autograd
    # forms): equal to fp32 rounding of the logits' scale (AVX2 left 1.6e-6 on one logit of 1,024, at
    # a scale of ~10).
    assert (out.detach() - want).abs().max() <= 1e-6 * max(1.0, want.abs().max().item())


@torch.no_grad()
def test_in_place_state_gives_the_same_step_and_only_it_overwrites_the_old_state(mixing_model):
    """``in_place_state`` (the engine's setting) writes each KDA state over the cache's tensor: the
    logits and caches are bit-equal to the default's, step after step; a state tensor taken before a
    step keeps its values by default, and is overwritten with the new state in place (the control
    that the in-place path ran)."""
    plain, inplace = _prefilled(mixing_model, [5, 12, 7], 11), _prefilled(mixing_model, [5, 12, 7], 11)
    steps = {False: DecodeStep(mixing_model), True: DecodeStep(mixing_model, in_place_state=True)}
    tok = torch.tensor([3, 9, 27])
    for _ in range(3):
        held = {k: [s.recurrent for s in c.layers if isinstance(s, KDAState)] for k, c in
                ((False, plain), (True, inplace))}
        before = {k: [t.clone() for t in v] for k, v in held.items()}
        a, b = steps[False].step(tok, plain), steps[True].step(tok, inplace)
        assert torch.equal(a, b)
        for x, y in zip(plain.layers, inplace.layers):
            if isinstance(x, KDAState):
                assert torch.equal(x.recurrent, y.recurrent) and torch.equal(x.conv, y.conv)
        new = [s.recurrent for s in inplace.layers if isinstance(s, KDAState)]
        for t, t0 in zip(held[False], before[False]):
            assert torch.equal(t, t0)                                   # the default leaves it alone
        for t, t0, n in zip(held[True], before[True], new):
            assert t is n and not torch.equal(t, t0)                    # in place: it is the new state
        tok = a.argmax(-1)
