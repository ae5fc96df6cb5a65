"""MXFP4 routed experts: QAT pass (k3.train.qat) and packed inference experts (k3.model.mx_experts)."""

import copy

import pytest
import torch

from k3.config import get_preset
from k3.model.decoder import K3ForCausalLM
from k3.model.moe import LatentMoE, RoutedExperts
from k3.model.mx_experts import PackedMXFP4Experts, pack_routed_experts
from k3.ops.mx import dequantize_mx, pack_fp4, quantize_mx
from k3.ops.situ import glu_act
from k3.train.qat import FakeQuantMXExperts, disable_qat, enable_qat


def _model(seed=0, **over):
    torch.manual_seed(seed)
    m = K3ForCausalLM(get_preset("nano", **over)).eval()
    for moe in m.moe_layers():  # spread the router so every expert sees tokens and weights vary in scale
        torch.nn.init.normal_(moe.gate.weight, 0.0, 0.5)
        for w in (moe.experts.w1, moe.experts.w3, moe.experts.w2):
            w.data.mul_(torch.exp(torch.randn(w.shape[0], w.shape[1], 1)))
    return m


def _ids(seed=1, shape=(2, 24), vocab=512):
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed))


def _ste(x, fmt):  # written out here, independent of fake_quant_mx
    dq = dequantize_mx(*quantize_mx(x.detach(), fmt), fmt, dtype=x.dtype)
    return x + (dq - x).detach()


def _reference_experts(experts, x, counts, acts=True):
    """Per-expert loop: fq8(x)·fq4(W)^T for w1, w3, then act, then fq8(h)·fq4(w2)^T
    (``acts=False``: weights-only, x·fq4(W)^T with no activation quantization)."""
    a = (lambda t: _ste(t, "fp8_e4m3")) if acts else (lambda t: t)
    out, start = [], 0
    for e, c in enumerate(counts.tolist()):
        xe = a(x[start:start + c])
        w1, w3, w2 = (_ste(w[e], "fp4_e2m1") for w in (experts.w1, experts.w3, experts.w2))
        h = experts.act(xe @ w1.T, xe @ w3.T)
        out.append(a(h) @ w2.T)
        start += c
    return torch.cat(out)


def _experts(seed=0, e=6, d=64, f=96):
    torch.manual_seed(seed)
    ex = RoutedExperts(e, d, f, glu_act(get_preset("nano")), init_std=0.05)
    for w in (ex.w1, ex.w3, ex.w2):
        w.data.mul_(torch.exp(2 * torch.randn(w.shape[0], w.shape[1], 1)))
    return ex


def test_enable_qat_swaps_only_routed_experts_and_keeps_parameters():
    m = _model()
    before = {k: v for k, v in m.named_parameters()}
    types = {n: type(mod) for n, mod in m.named_modules()}
    names = enable_qat(m)
    assert names == [f"model.layers.{l}.block_sparse_moe.experts" for l in range(1, 4)]
    assert enable_qat(m) == []  # idempotent
    after = dict(m.named_parameters())
    assert after.keys() == before.keys() and all(after[k] is before[k] for k in before)
    for n, mod in m.named_modules():
        assert type(mod) is (FakeQuantMXExperts if n in names else types[n]), n
    assert disable_qat(m) == names
    assert {n: type(mod) for n, mod in m.named_modules()} == types
    assert all(dict(m.named_parameters())[k] is before[k] for k in before)


def test_qat_forward_and_gradients_match_per_expert_reference():
    ex = _experts()
    counts = torch.tensor([5, 0, 9, 1, 0, 17])  # empty experts take the subset path
    x = (torch.randn(int(counts.sum()), 64) * torch.exp(torch.randn(int(counts.sum()), 1))).requires_grad_(True)
    offsets = counts.cumsum(0).to(torch.int32)
    qat = FakeQuantMXExperts(ex)
    y = qat(x, offsets)
    x_ref = x.detach().clone().requires_grad_(True)
    y_ref = _reference_experts(ex, x_ref, counts)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-6)
    assert (y - ex(x, offsets)).abs().max() > 1e-3  # quantization is actually applied
    g = torch.randn_like(y)
    (y * g).sum().backward()
    grads = [w.grad.clone() for w in (ex.w1, ex.w3, ex.w2)]
    for w in (ex.w1, ex.w3, ex.w2):
        w.grad = None
    (y_ref * g).sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-5, atol=1e-6)
    for got, w in zip(grads, (ex.w1, ex.w3, ex.w2)):
        torch.testing.assert_close(got, w.grad, rtol=1e-5, atol=1e-6)
        assert (got[[1, 4]] == 0).all()  # experts without tokens get no gradient


@pytest.mark.parametrize("act_fmt", [None, "fp8_e4m3"])
def test_packed_experts_apply_exactly_their_declared_activation_format(act_fmt):
    ex = _experts()
    counts = torch.tensor([5, 0, 9, 1, 0, 17])
    x = torch.randn(int(counts.sum()), 64) * torch.exp(torch.randn(int(counts.sum()), 1))
    offsets = counts.cumsum(0).to(torch.int32)
    packed = PackedMXFP4Experts.from_experts(ex, act_fmt=act_fmt)
    assert packed.act_fmt == act_fmt
    with torch.no_grad():
        y = packed(x, offsets)
        ref = _reference_experts(ex, x, counts, acts=act_fmt is not None)
        other = _reference_experts(ex, x, counts, acts=act_fmt is None)
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-6)
    assert (y - other).abs().max() > 1e-3  # the other format is measurably different


def test_packing_keeps_the_source_activation_format_unless_told():
    ex = _experts()
    assert PackedMXFP4Experts.from_experts(ex).act_fmt is None  # plain experts: weights-only
    assert PackedMXFP4Experts.from_experts(FakeQuantMXExperts(ex)).act_fmt == "fp8_e4m3"  # QAT: MXFP8
    assert PackedMXFP4Experts.from_experts(FakeQuantMXExperts(ex), act_fmt=None).act_fmt is None
    with pytest.raises(ValueError, match="act_fmt must be one of"):
        PackedMXFP4Experts(2, 32, 32, ex.act, act_fmt="fp8_e5m2")


def _moe(capacity_factor=None, seed=3):
    cfg = get_preset("nano")
    torch.manual_seed(seed)
    moe = LatentMoE(cfg, capacity_factor=capacity_factor).eval()
    torch.nn.init.normal_(moe.gate.weight, 0.0, 0.5)
    return moe, torch.randn(3, 10, cfg.hidden_size)


def test_disable_qat_restores_the_plain_forward_exactly():
    moe, x = _moe()
    with torch.no_grad():
        plain = moe(x)
        enable_qat(moe)
        assert not torch.equal(plain, moe(x))
        disable_qat(moe)
        assert torch.equal(moe(x), plain)


def test_packed_model_gives_exactly_the_qat_logits_in_prefill_and_decode():
    m = _model()
    enable_qat(m)
    packed = copy.deepcopy(m)
    names = pack_routed_experts(packed)
    assert len(names) == 3 and all(isinstance(packed.get_submodule(n), PackedMXFP4Experts) for n in names)
    assert not any("experts.w" in n for n, _ in packed.named_parameters())
    ids = _ids(shape=(1, 16))
    with torch.no_grad():
        cq, cp = m.new_cache(1), packed.new_cache(1)
        assert torch.equal(packed(ids[:, :14], cache=cp).logits, m(ids[:, :14], cache=cq).logits)
        # incremental decode: one token touches top-k of E experts (dequantize-only-active path)
        for t in (14, 15):
            assert torch.equal(packed(ids[:, t:t + 1], cache=cp).logits, m(ids[:, t:t + 1], cache=cq).logits)


@pytest.mark.parametrize("capacity_factor", [None, 1.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_moe_matches_qat_moe_in_both_dispatch_paths(capacity_factor, dtype):
    moe, x = _moe(capacity_factor)
    moe, x = moe.to(dtype), x.to(dtype)
    enable_qat(moe)
    packed = copy.deepcopy(moe)
    pack_routed_experts(packed)
    with torch.no_grad():
        assert torch.equal(packed(x), moe(x))


def test_packed_buffers_use_the_release_per_expert_layout():
    ex = _experts()
    p = PackedMXFP4Experts.from_experts(ex)
    assert set(p.state_dict()) == {f"w{i}_{k}" for i in (1, 2, 3) for k in ("packed", "scale")}
    for name, (out_f, in_f) in {"w1": (96, 64), "w3": (96, 64), "w2": (64, 96)}.items():
        packed, scale = getattr(p, f"{name}_packed"), getattr(p, f"{name}_scale")
        assert packed.shape == (6, out_f, in_f // 2) and scale.shape == (6, out_f, in_f // 32)
        assert packed.dtype == scale.dtype == torch.uint8
        for e in (0, 5):  # per-expert slice == quantizing that expert's [out, in] matrix alone
            codes, scales = quantize_mx(getattr(ex, name)[e].detach(), "fp4_e2m1")
            assert torch.equal(packed[e], pack_fp4(codes)) and torch.equal(scale[e], scales)
    qat = FakeQuantMXExperts(ex)
    for a, b in zip(p.expert_weights(), qat.expert_weights()):
        assert torch.equal(a, b)
    loaded = PackedMXFP4Experts(6, 64, 96, ex.act)
    loaded.load_state_dict(p.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(loaded.expert_weights(), p.expert_weights()))


def test_packed_bytes_are_4_25_over_16_of_bf16_for_small_preset():
    cfg = get_preset("small")
    ex = RoutedExperts(cfg.num_experts, cfg.expert_dim, cfg.moe_intermediate_size, glu_act(cfg))
    bf16 = sum(w.numel() * 2 for w in (ex.w1, ex.w3, ex.w2))
    p = PackedMXFP4Experts.from_experts(ex)
    assert p.nbytes() * 16 == bf16 * 4.25


def test_widths_that_are_not_whole_mx_blocks_are_rejected():
    ex = RoutedExperts(2, 48, 64, glu_act(get_preset("nano")))
    with pytest.raises(ValueError, match="expert dim ℓ to be a multiple of 32, got 48"):
        enable_qat(torch.nn.ModuleList([ex]))
    with pytest.raises(ValueError, match="multiple of 32"):
        PackedMXFP4Experts.from_experts(ex)
