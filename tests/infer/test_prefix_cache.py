"""PrefixCache: the radix tree on its own (synthetic states), then resuming a real nano model from it.

Synthetic states make every tensor traceable: the MLA latent of token t is ``tokens[t] + t/1000``
in every channel, a KDA snapshot after a prefix is filled with the prefix length, so a hit's
cache can be checked against values computed here, independently of the tree.
"""

import pytest
import torch

from k3.config import get_preset
from k3.errors import K3Error
from k3.infer.prefix_cache import PrefixCache
from k3.model.cache import K3Cache, KDAState
from k3.model.decoder import K3ForCausalLM

CFG = get_preset("nano")
LAC = CFG.linear_attn_config
N_KDA, N_MLA = len(LAC.kda_layers), len(LAC.full_attn_layers)
# Bytes written out from the config fields (fp32 states): per token of MLA latent KV, per snapshot.
KV_PER_TOKEN = N_MLA * (CFG.kv_lora_rank + CFG.qk_rope_head_dim) * 4
SNAPSHOT = N_KDA * (3 * LAC.num_heads * LAC.head_dim * (LAC.short_conv_kernel_size - 1)
                    + LAC.num_heads * LAC.head_dim * LAC.head_dim) * 4


def latent(tokens, width):
    t = torch.arange(len(tokens), dtype=torch.float32)
    return (torch.tensor(tokens, dtype=torch.float32) + t / 1000)[:, None].expand(-1, width)


def fake_cache(tokens):
    """A batch-1 cache that 'has seen' ``tokens``: traceable MLA latents, KDA filled with len."""
    cache = K3Cache(CFG, 1)
    P, K = LAC.num_heads * LAC.head_dim, LAC.short_conv_kernel_size
    for l, st in enumerate(cache.layers):
        if isinstance(st, KDAState):
            st.conv = torch.full((1, 3 * P, K - 1), float(len(tokens)))
            st.recurrent = torch.full((1, LAC.num_heads, LAC.head_dim, LAC.head_dim), float(len(tokens)))
        else:
            st.append(latent(tokens, CFG.kv_lora_rank)[None], latent(tokens, CFG.qk_rope_head_dim)[None])
    cache.seq_len = len(tokens)
    return cache


def check_hit(hit, tokens):
    """The hit cache holds exactly the synthetic state of ``tokens[:hit.length]``."""
    n = hit.length
    assert hit.cache.seq_len == n and hit.cache.batch_size == 1
    for st in hit.cache.layers:
        if isinstance(st, KDAState):
            assert torch.equal(st.conv, torch.full_like(st.conv, float(n)))
            assert torch.equal(st.recurrent, torch.full_like(st.recurrent, float(n)))
        else:
            assert torch.equal(st.c[0], latent(tokens[:n], CFG.kv_lora_rank))
            assert torch.equal(st.k_pe[0], latent(tokens[:n], CFG.qk_rope_head_dim))


A = list(range(100, 120))
C = list(range(200, 220))


def lengths(pc, *queries):
    return [pc.match(q).length for q in queries]


def test_match_returns_deepest_snapshot_leaving_one_token():
    pc = PrefixCache(cache_block=4, max_bytes=10**9)
    for n in (4, 8, 10):  # two block boundaries and a prompt end
        pc.insert(A[:n], fake_cache(A[:n]))
    assert lengths(pc, A[:11], A[:10], A[:9], A[:5], A[:4], A[:6] + [1, 2, 3], C[:12]) == [10, 8, 8, 4, 0, 4, 0]
    for q in (A[:11], A[:9], A[:6] + [1, 2, 3]):
        check_hit(pc.match(q), q)
    # A prompt-end sibling of a block node: a prefix of the block segment, matched when it fits.
    pc.insert(A[:6], fake_cache(A[:6]))
    assert lengths(pc, A[:7] + [9], A[:6] + [9], A[:12]) == [6, 6, 10]
    s = pc.stats()
    assert (s["hits"], s["misses"], s["entries"], s["nodes"]) == (11, 2, 4, 4)
    assert s["hit_tokens"] == 10 + 8 + 8 + 4 + 4 + 10 + 8 + 4 + 6 + 6 + 10 + 0


def test_kv_only_boundaries_are_never_matched():
    pc = PrefixCache(cache_block=4, max_bytes=10**9)
    pc.insert(A[:12], fake_cache(A[:12]))  # nodes at 4 and 8 hold KV only
    assert lengths(pc, A[:11] + [1], A[:9], A[:13]) == [0, 0, 12]
    check_hit(pc.match(A[:13]), A)


def test_hit_is_a_copy_and_insert_copies_its_input():
    pc = PrefixCache(cache_block=4, max_bytes=10**9)
    src = fake_cache(A[:8])
    pc.insert(A[:8], src)
    for st in src.layers:  # scribbling on the inserted cache does not reach the tree
        for t in ((st.conv, st.recurrent) if isinstance(st, KDAState) else (st.c, st.k_pe)):
            t.fill_(-1.0)
    hit = pc.match(A[:9])
    check_hit(hit, A)
    for st in hit.cache.layers:  # nor does scribbling on a hit
        for t in ((st.conv, st.recurrent) if isinstance(st, KDAState) else (st.c, st.k_pe)):
            t.add_(7.0)
    check_hit(pc.match(A[:9]), A)


def test_bytes_are_kv_per_token_plus_snapshots():
    pc = PrefixCache(cache_block=4, max_bytes=10**9)
    pc.insert(A[:8], fake_cache(A[:8]))
    assert pc.stats()["bytes"] == 8 * KV_PER_TOKEN + SNAPSHOT
    pc.insert(A[:4], fake_cache(A[:4]))   # KV shared, one more snapshot
    pc.insert(A[:10], fake_cache(A[:10]))  # 2 new tokens of KV
    pc.insert(A[:10], fake_cache(A[:10]))  # already there: nothing added
    pc.insert(A[:6] + C[:4], fake_cache(A[:6] + C[:4]))  # shares the first block only
    assert pc.stats()["bytes"] == (8 + 2 + 6) * KV_PER_TOKEN + 4 * SNAPSHOT
    pc.clear()
    assert pc.stats() == dict(hits=0, misses=0, hit_tokens=0, evictions=0, bytes=0, entries=0, nodes=0)


def test_lru_drops_internal_snapshots_keeping_kv_and_frees_leaves_with_their_kv():
    P1, P2, P3 = A[:8], C[:8], list(range(300, 304))
    pc = PrefixCache(cache_block=4, max_bytes=16 * KV_PER_TOKEN + 3 * SNAPSHOT)
    for p in (P1, P2):
        pc.insert(p[:4], fake_cache(p[:4]))
        pc.insert(p, fake_cache(p))
    # 4 snapshots > budget: the oldest, P1@4 (internal), goes; its KV stays for P1@8.
    assert pc.stats()["bytes"] == 16 * KV_PER_TOKEN + 3 * SNAPSHOT and pc.stats()["evictions"] == 1
    assert lengths(pc, P1[:6], P1 + [0], P2[:6]) == [0, 8, 4]  # P1@8 and P2@4 are touched here
    pc.insert(P3, fake_cache(P3))  # +4 tokens +1 snapshot: P2@8 (leaf, oldest) goes with its KV
    s = pc.stats()
    assert s["bytes"] == (8 + 4 + 4) * KV_PER_TOKEN + 3 * SNAPSHOT and s["evictions"] == 2
    assert lengths(pc, P2 + [0], P2[:6], P1 + [0], P3 + [0]) == [4, 4, 8, 4]
    pc.insert(C[:12], fake_cache(C[:12]))  # +8 tokens +1 snapshot: oldest now P2@4 ... then P1@8
    s = pc.stats()
    # P2@4 is internal (C[:12] hangs below it): only its snapshot goes; still over, so P1@8 goes
    # with its KV (and P1@4, now a KV-only leaf).
    assert s["evictions"] == 4
    assert s["bytes"] == (4 + 12) * KV_PER_TOKEN + 2 * SNAPSHOT
    assert lengths(pc, P1 + [0], P2 + [0], P3 + [0], C[:13]) == [0, 0, 4, 12]


def test_budget_below_one_snapshot_keeps_nothing():
    tiny = PrefixCache(cache_block=4, max_bytes=SNAPSHOT)  # KV + snapshot of 4 tokens do not fit
    tiny.insert(A[:4], fake_cache(A[:4]))
    assert tiny.stats()["bytes"] == 0 and tiny.stats()["evictions"] == 1 and tiny.match(A[:5]).length == 0
    fits = PrefixCache(cache_block=4, max_bytes=4 * KV_PER_TOKEN + SNAPSHOT)  # positive control
    fits.insert(A[:4], fake_cache(A[:4]))
    assert fits.stats()["evictions"] == 0 and fits.match(A[:5]).length == 4


def test_bad_arguments_are_refused():
    for kw in (dict(cache_block=0, max_bytes=1), dict(cache_block=4, max_bytes=0),
               dict(cache_block=True, max_bytes=1), dict(cache_block=4, max_bytes=1.5)):
        with pytest.raises(K3Error, match="cache_block|max_bytes"):
            PrefixCache(**kw)
    pc = PrefixCache(cache_block=4, max_bytes=10**9)
    with pytest.raises(K3Error, match="has seen 4 tokens"):
        pc.insert(A[:5], fake_cache(A[:4]))
    with pytest.raises(K3Error, match="one sequence"):
        pc.insert(A[:4], K3Cache.cat([fake_cache(A[:4]), fake_cache(A[:4])]))
    with pytest.raises(K3Error, match="empty"):
        pc.insert([], K3Cache(CFG, 1))
    with pytest.raises(K3Error, match="layer 0 state is empty"):
        c = K3Cache(CFG, 1)
        c.seq_len = 4
        pc.insert(A[:4], c)
    pc.insert(A[:4], fake_cache(A[:4]))  # positive control
    other = K3Cache(get_preset("nano", vocab_size=1024), 1)
    other.layers = fake_cache(A[:4]).layers
    other.seq_len = 4
    with pytest.raises(K3Error, match="different config"):
        pc.insert(A[:4], other)
    assert pc.stats()["entries"] == 1 and pc.match(A[:5]).length == 4


# ---------------------------------------------------------------------- real model
@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return K3ForCausalLM(CFG).eval()


def assert_logits_close(got, want):
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))


def prefill_with_snapshots(model, pc, prompt, block):
    """The engine's way: batch 1, chunks of ``block`` tokens, insert at each boundary and the end."""
    cache = model.new_cache(1)
    with torch.no_grad():
        for s in range(0, len(prompt), block):
            model(torch.tensor([prompt[s:s + block]]), cache=cache)
            pc.insert(prompt[: s + len(prompt[s:s + block])], cache)
    return cache


def test_resume_from_every_boundary_equals_cold_forward(model):
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(1, CFG.vocab_size, (37,), generator=g).tolist()
    pc = PrefixCache(cache_block=8, max_bytes=10**9)
    prefill_with_snapshots(model, pc, prompt, 8)
    for d in (8, 16, 24, 32, 37):
        suffix = torch.randint(1, CFG.vocab_size, (9,), generator=g).tolist()
        if d < len(prompt) and suffix[0] == prompt[d]:
            suffix[0] = prompt[d] % (CFG.vocab_size - 1) + 1
        q = prompt[:d] + suffix
        hit = pc.match(q)
        assert hit.length == d
        with torch.no_grad():
            resumed = model(torch.tensor([q[d:]]), cache=hit.cache).logits
            cold = model(torch.tensor([q])).logits[:, d:]
        assert_logits_close(resumed, cold)


def test_mla_kv_without_its_kda_state_is_not_used(model):
    g = torch.Generator().manual_seed(2)
    prompt = torch.randint(1, CFG.vocab_size, (37,), generator=g).tolist()
    # Room for the prompt's KV and one snapshot: the boundary snapshots at 8..32 are evicted as
    # newer ones arrive, their KV stays (the prompt-end snapshot at 37 needs it).
    pc = PrefixCache(cache_block=8, max_bytes=37 * KV_PER_TOKEN + SNAPSHOT)
    prefill_with_snapshots(model, pc, prompt, 8)
    assert pc.stats()["entries"] == 1 and pc.stats()["bytes"] == 37 * KV_PER_TOKEN + SNAPSHOT
    q = prompt[:16] + [prompt[16] % (CFG.vocab_size - 1) + 1] + prompt[17:30]
    assert pc.match(q).length == 0  # the depth-16 node has KV but no KDA state
    assert pc.match(prompt + [5]).length == 37  # positive control: the snapshot that exists
    with torch.no_grad():
        cold = model(torch.tensor([q])).logits[:, 16:]
        # What using that node would mean: the correct MLA KV of 16 tokens with a KDA state that
        # is not the one after those 16 tokens (fresh, or the one after 8 tokens).
        right = model.new_cache(1)
        model(torch.tensor([q[:16]]), cache=right)
        at8 = model.new_cache(1)
        model(torch.tensor([q[:8]]), cache=at8)
        for wrong_kda in ("fresh", "at8"):
            forced = right.clone()
            for l in CFG.kda_layer_ids:
                forced.layers[l] = KDAState(1, LAC.num_heads, LAC.head_dim, LAC.short_conv_kernel_size) \
                    if wrong_kda == "fresh" else at8.layers[l].clone()
            got = model(torch.tensor([q[16:]]), cache=forced).logits
            assert (got - cold).abs().max() > 1e-2 * cold.abs().max(), wrong_kda
        assert_logits_close(model(torch.tensor([q[16:]]), cache=right.clone()).logits, cold)
