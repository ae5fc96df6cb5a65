"""Per-sequence cache lengths: a batch of rows at different lengths behaves as each row run alone.

The reference for every check is independent of the cache: each sequence fed alone through the full
(no-cache) forward of the same model.
"""

import pytest
import torch

from k3.config import get_preset
from k3.errors import K3Error
from k3.model.cache import K3Cache, KDAState, MLAState
from k3.model.decoder import K3ForCausalLM
from k3.model.kda import KimiDeltaAttention

# nano with two MLA layers (one mid-stack) so a mask bug in either shows downstream of the other.
CFG = get_preset("nano", linear_attn_config={"kda_layers": [1, 3], "full_attn_layers": [2, 4],
                                             "num_heads": 2, "head_dim": 32})
LENGTHS = [3, 7, 1, 12, 5, 9, 2, 6]


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return K3ForCausalLM(CFG).eval()


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, CFG.vocab_size, (n,), generator=g) for n in LENGTHS]


def full_logits(model, ids):
    """Logits at the last position of ``ids`` [T], by the full no-cache forward (the reference)."""
    with torch.no_grad():
        return model(ids[None]).logits[0, -1]


def prefilled(model, prompts):
    """One batch cache from per-sequence batch-1 prefills (different lengths), and their last logits."""
    caches, logits = [], []
    with torch.no_grad():
        for p in prompts:
            c = model.new_cache(1)
            logits.append(model(p[None], cache=c, logits_to_keep=1).logits[0, -1])
            caches.append(c)
    return K3Cache.cat(caches), torch.stack(logits)


def test_mixed_batch_greedy_decode_matches_each_sequence_alone(model, prompts):
    cache, logits = prefilled(model, prompts)
    assert cache.seq_lens.tolist() == LENGTHS
    seqs = [p.clone() for p in prompts]
    for step in range(8):
        for b, s in enumerate(seqs):
            assert rel(logits[b], full_logits(model, s)) < 1e-5, (step, b)
        nxt = logits.argmax(-1)
        for b in range(len(seqs)):
            assert int(nxt[b]) == int(full_logits(model, seqs[b]).argmax())
            seqs[b] = torch.cat([seqs[b], nxt[b:b + 1]])
        with torch.no_grad():
            logits = model(nxt[:, None], cache=cache, logits_to_keep=1).logits[:, -1]
    assert cache.seq_lens.tolist() == [n + 8 for n in LENGTHS]


@pytest.mark.parametrize("impl", ["naive", "absorb"])
def test_mixed_batch_multi_token_continuation(model, prompts, impl):
    """Every row feeds T = 4 new tokens at its own positions (prefill with a cache, padded rows)."""
    cache, _ = prefilled(model, prompts)
    more = torch.randint(0, CFG.vocab_size, (len(LENGTHS), 4), generator=torch.Generator().manual_seed(2))
    for layer in model.model.layers:
        if not layer.is_kda:
            layer.self_attn.attn_impl = impl
    try:
        with torch.no_grad():
            got = model(more, cache=cache).logits                         # [B, 4, V]
            for b, p in enumerate(prompts):
                want = model(torch.cat([p, more[b]])[None]).logits[0, -4:]
                assert rel(got[b], want) < 1e-5, b
    finally:
        for layer in model.model.layers:
            if not layer.is_kda:
                layer.self_attn.attn_impl = "auto"


def test_split_select_clone_nbytes_with_mixed_lengths(model, prompts):
    cache, _ = prefilled(model, prompts)
    r, p = CFG.kv_lora_rank, CFG.qk_rope_head_dim
    mla_ids = [l for l in range(CFG.num_hidden_layers) if not CFG.is_kda_layer(l)]
    parts = cache.split()
    for b, part in enumerate(parts):
        assert part.seq_len == LENGTHS[b]
        for l in mla_ids:
            st = part.layers[l]
            assert st.c.shape == (1, LENGTHS[b], r) and st.k_pe.shape == (1, LENGTHS[b], p)  # no padding
            c_b, pe_b = cache.layers[l].row(b)
            torch.testing.assert_close(st.c[0], c_b)
            torch.testing.assert_close(pe_b, st.k_pe[0])
    lac = CFG.linear_attn_config
    P = lac.num_heads * lac.head_dim
    per_row_kda = 4 * (3 * P * (lac.short_conv_kernel_size - 1) + lac.num_heads * lac.head_dim ** 2)
    want = (CFG.num_hidden_layers - len(mla_ids)) * per_row_kda * len(LENGTHS) \
        + len(mla_ids) * 4 * (r + p) * sum(LENGTHS)
    assert cache.nbytes() == want == sum(part.nbytes() for part in parts)
    sub = cache.select([3, 1])
    assert sub.seq_lens.tolist() == [12, 7] and sub.layers[mla_ids[0]].c.shape[1] == 12
    fork = cache.clone()
    ids = torch.randint(0, CFG.vocab_size, (len(LENGTHS), 1))
    with torch.no_grad():
        a = model(ids, cache=fork).logits
        b = model(ids, cache=cache).logits
        c = model(ids[[3, 1]], cache=sub).logits
    torch.testing.assert_close(a, b)
    torch.testing.assert_close(c, b[[3, 1]], rtol=1e-5, atol=1e-6)


def test_seq_len_property_needs_equal_rows(model, prompts):
    cache, _ = prefilled(model, prompts[:2])
    with pytest.raises(K3Error, match="seq_lens"):
        cache.seq_len
    with pytest.raises(K3Error, match="lengths"):
        cache.layers[CFG.mla_layer_ids[0]].length
    same = K3Cache.cat(prefilled(model, [prompts[0], prompts[0]])[0].split())
    assert same.seq_len == LENGTHS[0] and same.layers[CFG.mla_layer_ids[0]].length == LENGTHS[0]


def test_cat_with_an_empty_cache_starts_that_row_fresh(model, prompts):
    """A fresh (never fed) cache joins a filled one: its KDA state is zeros, its MLA row empty."""
    filled, _ = prefilled(model, prompts[3:4])
    both = K3Cache.cat([filled, model.new_cache(1)])
    assert both.seq_lens.tolist() == [LENGTHS[3], 0]
    ids = torch.stack([prompts[0][:1], prompts[0][:1]])
    with torch.no_grad():
        got = model(ids, cache=both).logits[:, -1]
    assert rel(got[0], full_logits(model, torch.cat([prompts[3], prompts[0][:1]]))) < 1e-5
    assert rel(got[1], full_logits(model, prompts[0][:1])) < 1e-5


def test_kda_rows_are_independent():
    """KDA state is constant-size per row: batching rows with different histories changes nothing."""
    torch.manual_seed(3)
    layer = KimiDeltaAttention(CFG, CFG.kda_layer_ids[0])
    lac = CFG.linear_attn_config
    xs = [torch.randn(1, n, CFG.hidden_size) for n in (2, 9, 5)]
    states, alone = [], []
    step = torch.randn(3, 1, CFG.hidden_size)
    with torch.no_grad():
        for b, x in enumerate(xs):
            st = KDAState(1, lac.num_heads, lac.head_dim, lac.short_conv_kernel_size)
            layer(x, st)
            states.append(st)
            ref = layer(torch.cat([x, step[b:b + 1]], 1))[:, -1:]              # full forward, no state
            alone.append(ref)
        batch = KDAState.cat(states)
        assert batch.recurrent.shape == (3, lac.num_heads, lac.head_dim, lac.head_dim)
        got = layer(step, batch)
    assert rel(got, torch.cat(alone)) < 1e-5


def test_mla_state_cat_pads_with_zeros_and_appends_per_row():
    a, b = MLAState(1, 4, 2), MLAState(2, 4, 2)
    ca, cb = torch.randn(1, 3, 4), torch.randn(2, 5, 4)
    a.append(ca, torch.randn(1, 3, 2))
    b.append(cb, torch.randn(2, 5, 2))
    st = MLAState.cat([a, b])
    assert st.lengths.tolist() == [3, 5, 5] and st.c.shape == (3, 5, 4) and not st.uniform
    assert torch.equal(st.c[0, 3:], torch.zeros(2, 4))
    new = torch.randn(3, 2, 4)
    st.append(new, torch.randn(3, 2, 2))
    torch.testing.assert_close(st.row(0)[0], torch.cat([ca[0], new[0]]))
    torch.testing.assert_close(st.row(2)[0], torch.cat([cb[1], new[2]]))
    assert st.lengths.tolist() == [5, 7, 7] and st.nbytes() == 4 * 6 * 19
    with pytest.raises(K3Error, match="out of range"):
        st.row(3)
