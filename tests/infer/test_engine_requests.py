"""Engine request handling: bad input fails that request only, cancel frees the slot and its
cache at once, 200 random submit/cancel operations leave nothing behind, the byte budget, loading
a checkpoint directory, and close()."""

from __future__ import annotations

import random
import time

import pytest
import torch

from k3.errors import K3Error
from k3.infer.engine import Engine
from k3.infer.sampling import SamplingParams

pytestmark = pytest.mark.usefixtures("no_engine_thread_left")

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


def _prompt(n, seed=0):
    return torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


BAD = [
    ([], GREEDY, "prompt: empty"),
    ([1] * 2048, GREEDY, "max_position_embeddings=2048"),
    ([1, 2, 512], GREEDY, "token id 512 outside the vocabulary"),
    ([1, -1], GREEDY, "token id -1 outside"),
    ([1, "a"], GREEDY, "prompt: must be a sequence of int token ids"),
    (7, GREEDY, "prompt: must be a sequence of int token ids"),
    ([1, 2], {"temperature": -1.0}, "SamplingParams.temperature"),
    ([1, 2], {"top_p": 0.0}, "SamplingParams.top_p"),
    ([1, 2], {"top_p": 1.5}, "SamplingParams.top_p"),
    ([1, 2], {"max_tokens": 0}, "SamplingParams.max_tokens"),
    ([1, 2], {"stop": ["x"]}, "SamplingParams.stop: stop strings need a tokenizer"),
    ([1, 2], {"stop_token_ids": [600]}, "SamplingParams.stop_token_ids: 600 outside"),
]


def test_bad_requests_fail_alone_and_the_others_are_unaffected(model):
    good = _prompt(9, 1)
    with Engine(model, max_batch=4) as eng:
        alone = eng.submit(good, GREEDY).result().token_ids
        first = eng.submit(good, GREEDY)
        bad = [eng.submit(p, q) for p, q, _ in BAD]
        last = eng.submit(_prompt(5, 2), GREEDY)
        for h, (_, _, msg) in zip(bad, BAD):
            with pytest.raises(K3Error, match=msg):
                h.result()
        assert first.result().token_ids == alone  # positive control beside the failures
        assert len(last.result().token_ids) == GREEDY.max_tokens
        st = eng.stats()
    assert st["failed"] == len(BAD) and st["active"] == 0


def sequence_cache_bytes(config, T: int) -> int:
    """fp32 cache of one sequence, by hand: per KDA layer conv [3·nh·d, K-1] + state [nh, d, d];
    per MLA layer T tokens of (kv_lora_rank + qk_rope_head_dim)."""
    lac = config.linear_attn_config
    n_kda = len(config.kda_layer_ids)
    kda = 3 * lac.num_heads * lac.head_dim * (lac.short_conv_kernel_size - 1) + lac.num_heads * lac.head_dim ** 2
    mla = T * (config.kv_lora_rank + config.qk_rope_head_dim)
    return 4 * (n_kda * kda + (config.num_hidden_layers - n_kda) * mla)


def test_output_stops_at_max_position_embeddings(model):
    with Engine(model) as eng:
        out = eng.submit([3] * 2040, SamplingParams(max_tokens=100, temperature=0, ignore_eos=True)).result()
        short = eng.submit([3] * 20, SamplingParams(max_tokens=100, temperature=0, ignore_eos=True)).result()
    assert len(out.token_ids) == 2048 - 2040 and out.finish_reason == "length"
    assert len(short.token_ids) == 100  # positive control: the cap is the model's limit, not max_tokens


def test_cache_budget_smaller_than_one_sequence(model):
    need = sequence_cache_bytes(model.config, 10 + 8)
    with Engine(model, max_cache_bytes=need - 1) as eng:
        with pytest.raises(K3Error, match=f"max_cache_bytes={need - 1} is smaller"):
            eng.submit(_prompt(10), GREEDY).result()
        assert len(eng.submit(_prompt(9), GREEDY).result().token_ids) == 8  # fits: one token less
    with Engine(model, max_cache_bytes=need) as eng:  # exactly one sequence: the rest queue
        hs = [eng.submit(_prompt(10, s), GREEDY) for s in range(3)]
        assert all(len(h.result().token_ids) == 8 for h in hs)


def test_reserved_bytes_formula_matches_the_real_cache(model):
    with Engine(model) as eng:
        h = eng.submit(_prompt(20), SamplingParams(max_tokens=50, temperature=0, ignore_eos=True))
        for i, _ in enumerate(h):
            if i == 9:  # 20 prompt + 8 fed back at the last measured step (more by now)
                st = eng.stats()
                break
        h.cancel()
    used = st["kda_state_bytes"] + st["mla_latent_bytes"]
    assert used in {sequence_cache_bytes(model.config, T) for T in range(28, 70)}
    assert st["kda_state_bytes"] == sequence_cache_bytes(model.config, 0)


def test_cancel_mid_stream_frees_the_slot_and_memory(model):
    with Engine(model, max_batch=2) as eng:
        other = eng.submit(_prompt(7, 3), SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
        h = eng.submit(_prompt(12, 4), SamplingParams(max_tokens=1000, temperature=0, ignore_eos=True))
        events = []
        for ev in h:
            events.append(ev)
            if len(events) == 3:
                h.cancel()
        assert events[-1].finish_reason == "cancelled" and len(events) < 1000
        queued = eng.submit(_prompt(5, 5), GREEDY)  # takes the freed slot
        assert len(queued.result().token_ids) == 8
        assert len(other.result().token_ids) == 30
        st = eng.stats()
    assert st["active"] == 0 and st["kda_state_bytes"] == 0 and st["mla_latent_bytes"] == 0


def test_200_random_submits_and_cancels_leak_nothing(model):
    rng = random.Random(0)
    t0 = time.monotonic()
    with Engine(model, max_batch=4, prefill_chunk=16) as eng:
        live = []
        for _ in range(200):
            if live and rng.random() < 0.4:
                live.pop(rng.randrange(len(live))).cancel()
            else:
                n = rng.randint(1, 40)
                live.append(eng.submit(_prompt(n, rng.randrange(10**6)),
                                       SamplingParams(max_tokens=rng.randint(1, 12), temperature=rng.choice([0, 1.0]),
                                                      ignore_eos=True)))
            if rng.random() < 0.1:
                time.sleep(0.005)
        reasons = [h.result().finish_reason for h in live]
        st = eng.stats()
    assert set(reasons) <= {"length", "cancelled"}
    assert st["active"] == 0 and st["waiting"] == 0 and st["kda_state_bytes"] == 0 and st["mla_latent_bytes"] == 0
    assert st["finished"] + st["failed"] >= 120 and st["failed"] == 0
    assert time.monotonic() - t0 < 120


def test_close_fails_open_requests_and_joins(model):
    eng = Engine(model, max_batch=1)
    h = eng.submit(_prompt(4), SamplingParams(max_tokens=1500, temperature=0, ignore_eos=True))
    next(iter(h))
    eng.close()
    with pytest.raises(K3Error, match="closed"):
        h.result()
    with pytest.raises(K3Error, match="closed"):
        eng.submit(_prompt(4), GREEDY).result()


def test_engine_from_a_checkpoint_directory(model, tmp_path):
    from k3.checkpoint import save_pretrained
    from k3.data.tokenizer import train_tokenizer

    save_pretrained(model, tmp_path)
    tok = train_tokenizer(["hello world, hello there. " * 20], vocab_size=300)
    tok.save(tmp_path)
    p = tok.encode("hello world")
    with Engine(model) as eng:
        want = eng.submit(p, GREEDY).result().token_ids
    with Engine(str(tmp_path)) as eng:
        out = eng.submit(p, GREEDY).result()
    assert out.token_ids == want and out.text == tok.decode(want)
    with pytest.raises(K3Error, match="max_batch must be an int >= 1"):
        Engine(model, max_batch=0)
    with pytest.raises(K3Error, match="prefix_cache_bytes must be an int >= 0"):
        Engine(model, prefix_cache_bytes=-1)
    with pytest.raises(K3Error, match="max_cache_bytes must be an int >= 0"):
        Engine(model, max_cache_bytes=1.5)


def test_a_handle_read_twice_and_result_after_iterating(model):
    with Engine(model) as eng:
        h = eng.submit(_prompt(5), GREEDY)
        first = next(iter(h))
        rest = list(h)
        assert [first, *rest] == h.events and list(h) == []  # read to its end: nothing more
        res = h.result()
        assert res.token_ids == [e.token_id for e in [first, *rest]] and res.finish_reason == "length"
        assert res == h.result() and len(res.token_ids) == GREEDY.max_tokens
        bad = eng.submit([], GREEDY)
        for _ in range(2):  # a failed handle raises every time it is read
            with pytest.raises(K3Error, match="prompt: empty"):
                list(bad)
