"""K3Model / K3ForCausalLM: AttnRes bookkeeping, incremental decoding, parameter totals, bad input."""

import sysconfig
from pathlib import Path

import pytest
import torch

from k3.config import get_preset
from k3.model.decoder import K3ForCausalLM
from k3.model.summary import build_meta_model, parameter_breakdown


def _model(preset="nano", seed=0, **over):
    torch.manual_seed(seed)
    return K3ForCausalLM(get_preset(preset, **over)).eval()


def _ref_mix(sources, w, g, eps):
    """Independent AttnRes mix: explicit loop over sources."""
    if len(sources) == 1:
        return sources[0]
    logits, vals = [], []
    for v in sources:
        v = v.double()
        key = v / torch.sqrt(v.pow(2).mean(-1, keepdim=True) + eps) * g.double()
        logits.append((key * w.reshape(-1).double()).sum(-1))
        vals.append(v)
    a = torch.softmax(torch.stack(logits), 0)
    return sum(a[i, ..., None] * vals[i] for i in range(len(vals)))


def test_attn_res_bookkeeping_matches_full_depth_reference():
    m = _model(num_hidden_layers=7, attn_res_block_size=3,
               linear_attn_config={"kda_layers": [1, 2, 3, 5, 6], "full_attn_layers": [4, 7],
                                   "num_heads": 2, "head_dim": 32})
    for n, p in m.named_parameters():
        if "_res_proj" in n:
            p.data.normal_(0, 1.0)  # non-uniform mixing
        if "_res_norm" in n:
            p.data.uniform_(0.5, 1.5)
    rec = {}

    def save(key, out=True):
        def hook(mod, inp, outp):
            rec[key] = (outp if out else inp[0]).detach()
        return hook

    for l, layer in enumerate(m.model.layers):
        layer.input_layernorm.register_forward_hook(save(("attn_in", l), out=False))
        layer.post_attention_layernorm.register_forward_hook(save(("mlp_in", l), out=False))
        layer.self_attn.register_forward_hook(save(("attn_out", l)))
        layer.ffn.register_forward_hook(save(("mlp_out", l)))
    m.model.norm.register_forward_hook(save("final_in", out=False))
    m.model.embed_tokens.register_forward_hook(save("embed"))
    ids = torch.randint(0, 512, (2, 9))
    m(ids)

    B, eps, L = 3, m.config.rms_norm_eps, 7
    outs = [rec["embed"].double()]  # every sublayer output in depth order
    for l in range(L):
        outs += [rec[("attn_out", l)].double(), rec[("mlp_out", l)].double()]

    def sources(upto):  # upto = number of sublayer outputs (after embed) already produced
        layer_of = lambda i: (i - 1) // 2  # sublayer index i>=1 belongs to layer (i-1)//2
        srcs, cur, cur_block = [outs[0]], None, 0
        for i in range(1, upto + 1):
            b = layer_of(i) // B
            if b != cur_block:
                srcs.append(cur)
                cur, cur_block = None, b
            cur = outs[i] if cur is None else cur + outs[i]
        return srcs, cur, cur_block

    for l in range(L):
        lay = m.model.layers[l]
        srcs, cur, cb = sources(2 * l)
        if l % B == 0:  # a new block starts here: the finished partial becomes a block
            if cur is not None:
                srcs = srcs + [cur]
            full = srcs
        else:
            full = srcs + [cur]
        ref = _ref_mix(full, lay.self_attention_res_proj.weight, lay.self_attention_res_norm.weight, eps)
        torch.testing.assert_close(rec[("attn_in", l)].double(), ref, rtol=1e-5, atol=1e-5)
        srcs, cur, cb = sources(2 * l + 1)
        full = srcs + [cur]
        ref = _ref_mix(full, lay.mlp_res_proj.weight, lay.mlp_res_norm.weight, eps)
        torch.testing.assert_close(rec[("mlp_in", l)].double(), ref, rtol=1e-5, atol=1e-5)
    srcs, cur, _ = sources(2 * L)
    ref = _ref_mix(srcs + [cur], m.model.output_attn_res_proj.weight, m.model.output_attn_res_norm.weight, eps)
    torch.testing.assert_close(rec["final_in"].double(), ref, rtol=1e-5, atol=1e-5)


def test_zero_pseudo_queries_give_uniform_mean_at_init():
    m = _model()
    rec = {}
    m.model.layers[1].input_layernorm.register_forward_hook(lambda mod, i, o: rec.setdefault("in", i[0]))
    m.model.layers[0].self_attn.register_forward_hook(lambda mod, i, o: rec.setdefault("a0", o))
    m.model.layers[0].ffn.register_forward_hook(lambda mod, i, o: rec.setdefault("m0", o))
    m.model.embed_tokens.register_forward_hook(lambda mod, i, o: rec.setdefault("e", o))
    m(torch.randint(0, 512, (1, 5)))
    # nano: block size 2, so layer 1's attention sees [embed, a0 + m0] with equal weights
    torch.testing.assert_close(rec["in"], (rec["e"] + rec["a0"] + rec["m0"]) / 2, rtol=1e-5, atol=1e-6)


def test_standard_residual_when_block_size_is_none():
    m = _model(attn_res_block_size=None)
    assert not any("_res_" in n for n, _ in m.named_parameters())
    rec = {}
    m.model.layers[1].input_layernorm.register_forward_hook(lambda mod, i, o: rec.setdefault("in", i[0]))
    m.model.layers[0].self_attn.register_forward_hook(lambda mod, i, o: rec.setdefault("a0", o))
    m.model.layers[0].ffn.register_forward_hook(lambda mod, i, o: rec.setdefault("m0", o))
    m.model.embed_tokens.register_forward_hook(lambda mod, i, o: rec.setdefault("e", o))
    m(torch.randint(0, 512, (1, 5)))
    torch.testing.assert_close(rec["in"], rec["e"] + rec["a0"] + rec["m0"])


@pytest.mark.parametrize("preset_over", [{}, {"attn_res_block_size": None, "hidden_act": "silu"}])
def test_prefill_then_decode_matches_full_forward(preset_over):
    m = _model(**preset_over)
    ids = torch.randint(0, 512, (2, 23))
    with torch.no_grad():
        full = m(ids).logits
        cache = m.new_cache(2)
        parts = [m(ids[:, :7], cache=cache).logits, m(ids[:, 7:12], cache=cache).logits]
        for t in range(12, 23):
            parts.append(m(ids[:, t:t + 1], cache=cache).logits)
    inc = torch.cat(parts, 1)
    assert cache.seq_len == 23
    rel = (inc - full).norm() / full.norm()
    assert rel <= 1e-5, rel


def test_loss_is_mean_next_token_cross_entropy():
    m = _model()
    ids = torch.randint(0, 512, (2, 10))
    labels = ids.clone()
    labels[0, 4] = -100
    out = m(ids, labels=labels)
    lp = torch.log_softmax(out.logits.double(), -1)
    terms = [-lp[b, t, labels[b, t + 1]] for b in range(2) for t in range(9) if labels[b, t + 1] != -100]
    torch.testing.assert_close(out.loss.double(), torch.stack(terms).mean(), rtol=1e-5, atol=1e-6)


def test_k3_preset_on_meta_has_released_totals():
    b = parameter_breakdown(build_meta_model(get_preset("k3")))
    assert b.total == 2_779_484_476_000
    assert round(b.activated / 1e9, 1) == 104.2
    assert b.routed_experts == 92 * 896 * 3 * 3584 * 3072


def test_kimi_linear_48b_on_meta():
    b = parameter_breakdown(build_meta_model(get_preset("kimi-linear-48b")))
    # moonshotai/Kimi-Linear-48B-A3B: exact totals of the released checkpoint's tensors
    assert b.total == 49_122_681_728
    assert b.activated == 3_106_972_544


def test_bad_inputs_are_named():
    m = _model()
    with pytest.raises(ValueError, match="outside the vocabulary"):
        m(torch.tensor([[1, 512]]))
    with pytest.raises(ValueError, match=r"\[batch, seq\]"):
        m(torch.tensor([1, 2]))
    with pytest.raises(TypeError, match="integer"):
        m(torch.zeros(1, 3))
    other = K3ForCausalLM(get_preset("nano", num_experts=4))
    with pytest.raises(ValueError):
        m(torch.tensor([[1, 2]]), cache=other.new_cache(1))
    with pytest.raises(ValueError):
        m(torch.tensor([[1, 2]]), cache=m.new_cache(3))
    with pytest.raises(TypeError, match="K3Cache"):
        m(torch.tensor([[1, 2]]), cache={})


@pytest.mark.slow
def test_nano_loss_falls_on_real_text():
    root = Path(sysconfig.get_paths()["stdlib"])
    text = (root / "textwrap.py").read_bytes() + (root / "fnmatch.py").read_bytes()
    data = torch.tensor(list(text), dtype=torch.long)  # bytes as token ids (< 512)
    torch.manual_seed(0)
    m = K3ForCausalLM(get_preset("nano")).train()
    opt = torch.optim.AdamW(m.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(0)
    losses = []
    for step in range(40):
        starts = torch.randint(0, len(data) - 129, (8,), generator=g)
        batch = torch.stack([data[s:s + 128] for s in starts])
        loss = m(batch, labels=batch).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert sum(losses[:5]) / 5 > 5.5  # ~ln(512) at init
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 2.0, losses
