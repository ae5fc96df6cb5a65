"""K3Cache: layout per config, check errors, select / clone / split / cat semantics, MLA buffer growth."""

import pytest
import torch

from k3.config import get_preset
from k3.model.cache import K3Cache, KDAState, MLAState
from k3.model.kda import KimiDeltaAttention
from k3.model.mla import GatedMLA

CFG = get_preset("nano")
KDA_L, MLA_L = CFG.kda_layer_ids[0], CFG.mla_layer_ids[0]


@pytest.fixture(scope="module")
def layers():
    torch.manual_seed(0)
    return KimiDeltaAttention(CFG, KDA_L), GatedMLA(CFG, MLA_L)


def run(layers, cache, x):
    """Feed x [B,T,H] through one KDA and one MLA layer using their cache entries."""
    kda, mla = layers
    with torch.no_grad():
        out = kda(x, cache.layers[KDA_L]) + mla(x, cache.layers[MLA_L])
    cache.seq_len += x.shape[1]
    return out


def test_layout_follows_config():
    cache = K3Cache(CFG, 3)
    assert len(cache.layers) == CFG.num_hidden_layers
    for l, s in enumerate(cache.layers):
        assert isinstance(s, KDAState if CFG.is_kda_layer(l) else MLAState)
        assert s.batch_size == 3 and s.is_empty
    assert cache.seq_len == 0 and cache.nbytes() == 0


def test_invalid_batch_size():
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match="batch_size"):
            K3Cache(CFG, bad)


def test_check_names_the_mismatch():
    cache = K3Cache(CFG, 2)
    cache.check(CFG, 2)
    cache.check(get_preset("nano"), 2)  # equal config, different object
    with pytest.raises(ValueError, match="kv_lora_rank"):
        cache.check(CFG.replace(kv_lora_rank=16), 2)
    with pytest.raises(ValueError, match="batch_size=2.*batch of 3"):
        cache.check(CFG, 3)


def test_filled_state_shapes_and_nbytes(layers):
    cache = K3Cache(CFG, 2)
    run(layers, cache, torch.randn(2, 5, CFG.hidden_size))
    kda, mla = cache.layers[KDA_L], cache.layers[MLA_L]
    lac = CFG.linear_attn_config
    P = lac.num_heads * lac.head_dim
    assert kda.conv.shape == (2, 3 * P, lac.short_conv_kernel_size - 1)
    assert kda.recurrent.shape == (2, lac.num_heads, lac.head_dim, lac.head_dim)
    assert kda.recurrent.dtype == torch.float32
    assert mla.c.shape == (2, 5, CFG.kv_lora_rank) and mla.k_pe.shape == (2, 5, CFG.qk_rope_head_dim)
    want = 4 * (kda.conv.numel() + kda.recurrent.numel() + mla.c.numel() + mla.k_pe.numel())
    assert cache.nbytes() == want


def test_select_reorders_and_drops_sequences(layers):
    x = torch.randn(3, 6, CFG.hidden_size)
    cache = K3Cache(CFG, 3)
    run(layers, cache, x[:, :5])
    full = cache.clone()
    want = run(layers, full, x[:, 5:])            # decode all three
    sub = cache.select([2, 0])
    assert sub.batch_size == 2 and sub.seq_len == 5 and cache.batch_size == 3
    got = run(layers, sub, x[[2, 0], 5:])          # decode the reordered subset
    torch.testing.assert_close(got, want[[2, 0]])
    torch.testing.assert_close(sub.layers[MLA_L].c[:, :5], cache.layers[MLA_L].c[[2, 0]])
    rep = cache.select(torch.tensor([1, 1]))       # repeat (beam fan-out)
    torch.testing.assert_close(rep.layers[KDA_L].recurrent[0], rep.layers[KDA_L].recurrent[1])
    for bad in ([3], [-4], []):
        with pytest.raises(ValueError):
            cache.select(bad)


def test_clone_forks_a_prefix_independently(layers):
    x = torch.randn(1, 8, CFG.hidden_size)
    cache = K3Cache(CFG, 1)
    run(layers, cache, x[:, :4])
    fork = cache.clone()
    run(layers, fork, x[:, 6:8])                   # the fork continues with other tokens first ...
    got_orig = run(layers, cache, x[:, 4:6])       # ... which must not leak into the original
    got_fork = run(layers, fork, x[:, 4:5])
    assert cache.seq_len == 6 and fork.seq_len == 7 and fork.layers[MLA_L].length == 7
    fresh = K3Cache(CFG, 1)
    want_orig = run(layers, fresh, x[:, :6])[:, 4:6]
    fresh = K3Cache(CFG, 1)
    want_fork = run(layers, fresh, torch.cat([x[:, :4], x[:, 6:8], x[:, 4:5]], 1))[:, 6:]
    torch.testing.assert_close(got_orig, want_orig, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got_fork, want_fork, rtol=1e-5, atol=1e-6)


def test_split_then_cat_round_trips(layers):
    x = torch.randn(3, 5, CFG.hidden_size)
    cache = K3Cache(CFG, 3)
    run(layers, cache, x)
    parts = cache.split()
    assert [p.batch_size for p in parts] == [1, 1, 1]
    back = K3Cache.cat(parts)
    assert back.batch_size == 3 and back.seq_len == 5
    for s0, s1 in zip(cache.layers, back.layers):
        if isinstance(s0, KDAState) and not s0.is_empty:
            torch.testing.assert_close(s1.conv, s0.conv)
            torch.testing.assert_close(s1.recurrent, s0.recurrent)
        elif isinstance(s0, MLAState) and not s0.is_empty:
            torch.testing.assert_close(s1.c, s0.c)
            torch.testing.assert_close(s1.k_pe, s0.k_pe)
    y = torch.randn(3, 1, CFG.hidden_size)
    torch.testing.assert_close(run(layers, back, y), run(layers, cache, y))


def test_cat_rejects_mismatches(layers):
    a, b = K3Cache(CFG, 1), K3Cache(CFG, 1)
    run(layers, a, torch.randn(1, 3, CFG.hidden_size))
    run(layers, b, torch.randn(1, 2, CFG.hidden_size))
    assert K3Cache.cat([a, b]).seq_lens.tolist() == [3, 2]   # different lengths are fine
    with pytest.raises(ValueError, match="different configs"):
        K3Cache.cat([K3Cache(CFG, 1), K3Cache(CFG.replace(kv_lora_rank=16), 1)])
    with pytest.raises(ValueError):
        K3Cache.cat([])


def test_to_same_device_shares_nothing_that_later_steps_mutate(layers):
    cache = K3Cache(CFG, 1)
    run(layers, cache, torch.randn(1, 3, CFG.hidden_size))
    snapshot = cache.clone()
    moved = cache.to("cpu")
    assert moved.nbytes() == cache.nbytes() and moved.layers[KDA_L].recurrent.device.type == "cpu"
    run(layers, moved, torch.randn(1, 2, CFG.hidden_size))  # layers replace / regrow, never write shared memory
    assert cache.layers[MLA_L].length == 3 and moved.layers[MLA_L].length == 5
    for a, b in ((cache.layers[KDA_L].recurrent, snapshot.layers[KDA_L].recurrent),
                 (cache.layers[KDA_L].conv, snapshot.layers[KDA_L].conv),
                 (cache.layers[MLA_L].c, snapshot.layers[MLA_L].c)):
        torch.testing.assert_close(a, b)


def test_mla_state_appends_across_buffer_growth():
    st = MLAState(2, 4, 3)
    cs, pes = [], []
    for T in (1, 20, 1, 1, 40, 3):
        c, pe = torch.randn(2, T, 4), torch.randn(2, T, 3)
        cs.append(c)
        pes.append(pe)
        all_c, all_pe = st.append(c, pe)
        torch.testing.assert_close(all_c, torch.cat(cs, 1))
        torch.testing.assert_close(all_pe, torch.cat(pes, 1))
    assert st.length == 66 and st.nbytes() == 4 * 2 * 66 * 7
    copy = st.clone()
    assert copy._c.shape[1] == 66  # a clone carries no spare capacity
    st.append(torch.zeros(2, 1, 4), torch.zeros(2, 1, 3))
    assert copy.length == 66 and st.length == 67
    with pytest.raises(ValueError, match="batch_size=2"):
        st.append(torch.zeros(3, 1, 4), torch.zeros(3, 1, 3))
