"""cache_bytes_per_sequence: the k3 preset at 1M tokens by hand, and a real filled cache's bytes."""

import pytest
import torch

from k3.config import get_preset
from k3.errors import K3Error
from k3.model.cache import cache_bytes_per_sequence
from k3.model.decoder import K3ForCausalLM


def test_k3_preset_at_one_million_tokens_by_hand():
    cfg = get_preset("k3")
    lac = cfg.linear_attn_config
    # the preset's geometry, as released: 69 KDA + 24 MLA layers, 96 KDA heads of 128, kernel 4,
    # MLA latent 512 + rope 64
    assert (len(cfg.kda_layer_ids), len(cfg.mla_layer_ids)) == (69, 24)
    assert (lac.num_heads, lac.head_dim, lac.short_conv_kernel_size) == (96, 128, 4)
    assert (cfg.kv_lora_rank, cfg.qk_rope_head_dim) == (512, 64)
    T = 1_048_576
    got = cache_bytes_per_sequence(cfg, T, torch.bfloat16)
    recurrent = 96 * 128 * 128 * 4                  # fp32 S per layer: 6,291,456
    conv = 3 * (96 * 128) * (4 - 1) * 2             # q|k|v last 3 inputs, bf16: 221,184
    assert got["kda_state"] == 69 * (recurrent + conv) == 449_372_160
    assert got["mla_latent"] == 24 * T * (512 + 64) * 2 == 28_991_029_248
    assert got["total"] == 449_372_160 + 28_991_029_248
    assert got["all_mla_equivalent"] == 93 * T * 576 * 2 == 112_340_238_336
    fp32 = cache_bytes_per_sequence(cfg, T, torch.float32)
    assert fp32["kda_state"] == 69 * (recurrent + 2 * conv) and fp32["mla_latent"] == 2 * got["mla_latent"]
    assert cache_bytes_per_sequence(cfg, 0)["mla_latent"] == 0


def test_formula_equals_a_filled_cache():
    torch.manual_seed(0)
    cfg = get_preset("nano")
    model = K3ForCausalLM(cfg).eval()
    cache = model.new_cache(1)
    with torch.no_grad():
        model(torch.randint(0, cfg.vocab_size, (1, 23)), cache=cache)
    want = cache_bytes_per_sequence(cfg, 23, torch.float32)
    assert cache.nbytes() == want["total"]
    mla = sum(s.nbytes() for l, s in enumerate(cache.layers) if not cfg.is_kda_layer(l))
    assert mla == want["mla_latent"] and cache.nbytes() - mla == want["kda_state"]


def test_bad_arguments_are_named():
    cfg = get_preset("nano")
    assert cache_bytes_per_sequence(cfg, 5, torch.float16)["total"] > 0   # positive control
    for bad in (-1, 2.5, True):
        with pytest.raises(K3Error, match="T must be"):
            cache_bytes_per_sequence(cfg, bad)
    with pytest.raises(K3Error, match="dtype"):
        cache_bytes_per_sequence(cfg, 5, torch.int64)
