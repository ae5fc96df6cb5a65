import copy
import io
import math

import pytest
import torch
from torch import nn

from k3.config import get_preset
from k3.train import optim
from k3.train.optim import (
    Muon,
    build_optimizer,
    build_param_groups,
    classify_param,
    describe_param_groups,
    qk_clip_,
    zeropower_via_newtonschulz5,
)

A, B_, C = 3.4445, -4.7750, 2.0315


@pytest.fixture(autouse=True)
def _one_thread():
    # matrices here are tiny: threads only add spin-wait contention on a shared 2-core machine
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def ref_ns(g: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """Newton–Schulz quintic in float64 on one matrix, written out independently."""
    x = g.double()
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = x.t()
    x = x / (torch.linalg.matrix_norm(x) + 1e-7)
    for _ in range(steps):
        xxt = x @ x.t()
        x = A * x + B_ * (xxt @ x) + C * (xxt @ xxt @ x)
    return (x.t() if tall else x).float()


def test_newton_schulz_gives_near_orthogonal_update_aligned_with_uv():
    torch.manual_seed(0)
    for shape in [(32, 48), (48, 32), (40, 64)]:  # square Gaussians are ill-conditioned
        g = torch.randn(*shape)
        o = ref_ns(g)
        mine = zeropower_via_newtonschulz5(g, dtype=torch.float32)
        torch.testing.assert_close(mine, o, rtol=1e-4, atol=1e-4)
        default = zeropower_via_newtonschulz5(g)           # bf16, the default: near the same update
        assert default.dtype == g.dtype                    # (bf16's 8-bit mantissa: 3.1-3.6 % here)
        assert (default - o).norm() / o.norm() < 5e-2
        assert not torch.equal(default, mine)
        u, _, vh = torch.linalg.svd(g, full_matrices=False)
        for x in (mine, default):
            s = torch.linalg.svdvals(x)
            assert s.min() > 0.6 and s.max() < 1.25
            cos = (x * (u @ vh)).sum() / (x.norm() * (u @ vh).norm())
            assert cos > 0.95


def _bf16_iteration(g: torch.Tensor, steps: int) -> torch.Tensor:
    """NS5 in torch's bf16 ops (oneDNN's bf16 matmul where the CPU has it, a generic loop elsewhere)."""
    x = g.bfloat16()
    tall = x.shape[-2] > x.shape[-1]
    if tall:
        x = x.mT
    x = x / (x.norm(dim=(-2, -1), keepdim=True) + 1e-7)
    fma = torch.addmm if x.dim() == 2 else torch.baddbmm
    for _ in range(steps):
        xxt = x @ x.mT
        x = fma(x, fma(xxt, xxt, xxt, beta=B_, alpha=C), x, beta=A)
    return (x.mT if tall else x).float()


@pytest.mark.parametrize("shape", [(96, 64), (3, 64, 160)])
def test_bf16_newton_schulz_on_fp32_matmuls_keeps_bf16_numbers(shape):
    """Where the CPU has no bf16 matmul kernels, NS5 computes bf16 values with fp32 matmuls; each
    product of bf16 values is exact in fp32, so it is the bf16 iteration up to summation order."""
    torch.manual_seed(3)
    g = torch.randn(*shape)
    one = optim._newton_schulz(g, 1, torch.bfloat16, bf16_on_fp32=True)
    assert torch.equal(one, one.bfloat16().float())                      # bf16 values throughout
    # One step: the same bits here (AVX2, torch's generic bf16 loop); oneDNN's bf16 kernels sum in
    # another order, which can flip a rounding now and then.
    assert (one == _bf16_iteration(g, 1)).float().mean() >= 0.99
    fp32 = zeropower_via_newtonschulz5(g, dtype=torch.float32)
    native = _bf16_iteration(g, 5)
    emulated = optim._newton_schulz(g, 5, torch.bfloat16, bf16_on_fp32=True)
    # Five steps amplify the rare summation-order flips (here 0.26-0.34 % apart); bf16 vs fp32 is
    # 1.3 %: the path computes bf16's numbers, not fp32's (control: fp32 is far from both).
    assert (emulated - native).norm() < 0.4 * (native - fp32).norm()
    assert (emulated - fp32).norm() > 0.5 * (native - fp32).norm()


@pytest.mark.parametrize("native", [True, False])
def test_bf16_newton_schulz_picks_its_path_by_the_cpu(monkeypatch, native):
    g = torch.randn(40, 72)
    monkeypatch.setattr(optim, "cpu_bf16_matmul_is_native", lambda: native)
    got = zeropower_via_newtonschulz5(g)
    if native:
        assert torch.equal(got, _bf16_iteration(g, 5))
    else:
        assert torch.equal(got, optim._newton_schulz(g, 5, torch.bfloat16, bf16_on_fp32=True))
    assert not torch.equal(zeropower_via_newtonschulz5(g, dtype=torch.float32), got)  # fp32 stays fp32


def _one_param_opt(w, **kw):
    p = nn.Parameter(w.clone())
    # Newton-Schulz in fp32 (the default is bf16), so the update can be held to the float64 formula
    opt = Muon([dict(params=[p], **kw)], lr=0.01, weight_decay=0.1, momentum=0.9, ns_dtype=torch.float32)
    return p, opt


def test_muon_two_steps_match_moonlight_formula_with_nesterov_momentum():
    torch.manual_seed(1)
    w, g1, g2 = torch.randn(24, 40), torch.randn(24, 40), torch.randn(24, 40)
    p, opt = _one_param_opt(w)
    lr, wd, mu, scale = 0.01, 0.1, 0.9, 0.2 * math.sqrt(40)
    expect = w.clone()
    buf = torch.zeros_like(w)
    for g in (g1, g2):
        p.grad = g.clone()
        opt.step()
        buf = mu * buf + g
        expect = expect * (1 - lr * wd) - lr * scale * ref_ns(g + mu * buf)
        torch.testing.assert_close(p.data, expect, rtol=1e-4, atol=1e-5)


def test_per_head_update_equals_orthogonalizing_each_head_block():
    torch.manual_seed(2)
    nh, d, H = 4, 8, 32
    w, g = torch.randn(nh * d, H), torch.randn(nh * d, H)
    p, opt = _one_param_opt(w, block_rows=d)
    p.grad = g.clone()
    opt.step()
    u = g * 1.9  # first step: buf = g, nesterov g + 0.9·buf
    blocks = [ref_ns(u[h * d:(h + 1) * d]) for h in range(nh)]
    expect = w * (1 - 0.01 * 0.1) - 0.01 * 0.2 * math.sqrt(max(d, H)) * torch.cat(blocks)
    torch.testing.assert_close(p.data, expect, rtol=1e-4, atol=1e-5)
    # and it differs from full-matrix Muon
    q, opt2 = _one_param_opt(w)
    q.grad = g.clone()
    opt2.step()
    assert not torch.allclose(q.data, p.data, atol=1e-3)


def test_expert_stack_is_orthogonalized_per_expert():
    torch.manual_seed(3)
    E, F, L = 3, 16, 12
    w, g = torch.randn(E, F, L), torch.randn(E, F, L)
    p, opt = _one_param_opt(w)
    p.grad = g.clone()
    opt.step()
    expect = torch.stack([w[e] * (1 - 1e-3) - 0.01 * 0.2 * math.sqrt(F) * ref_ns(1.9 * g[e])
                          for e in range(E)])
    torch.testing.assert_close(p.data, expect, rtol=1e-4, atol=1e-5)


# --------------------------------------------------------------- fake model named as INTERFACES.md
def _fake_model(cfg):
    shapes = {}
    H, V = cfg.hidden_size, cfg.vocab_size
    lac = cfg.linear_attn_config
    P, d = lac.num_heads * lac.head_dim, lac.head_dim
    nh = cfg.num_attention_heads
    nope, rope, vd = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    shapes.update({"model.embed_tokens.weight": (V, H), "model.norm.weight": (H,),
                   "lm_head.weight": (V, H), "model.output_attn_res_proj.weight": (1, H),
                   "model.output_attn_res_norm.weight": (H,)})
    for l in range(cfg.num_hidden_layers):
        pre = f"model.layers.{l}."
        for n in ("input_layernorm", "post_attention_layernorm", "self_attention_res_norm",
                  "mlp_res_norm"):
            shapes[pre + n + ".weight"] = (H,)
        shapes[pre + "self_attention_res_proj.weight"] = (1, H)
        shapes[pre + "mlp_res_proj.weight"] = (1, H)
        a = pre + "self_attn."
        if cfg.is_kda_layer(l):
            for n in "qkv":
                shapes[a + f"{n}_proj.weight"] = (P, H)
                shapes[a + f"{n}_conv1d.weight"] = (P, 1, 4)
            shapes.update({a + "f_a_proj.weight": (d, H), a + "f_b_proj.weight": (P, d),
                           a + "b_proj.weight": (lac.num_heads, H), a + "A_log": (lac.num_heads,),
                           a + "dt_bias": (P,), a + "g_proj.weight": (P, H),
                           a + "o_norm.weight": (d,), a + "o_proj.weight": (H, P)})
        else:
            shapes.update({a + "q_a_proj.weight": (cfg.q_lora_rank, H),
                           a + "q_a_layernorm.weight": (cfg.q_lora_rank,),
                           a + "q_b_proj.weight": (nh * (nope + rope), cfg.q_lora_rank),
                           a + "kv_a_proj_with_mqa.weight": (cfg.kv_lora_rank + rope, H),
                           a + "kv_a_layernorm.weight": (cfg.kv_lora_rank,),
                           a + "kv_b_proj.weight": (nh * (nope + vd), cfg.kv_lora_rank),
                           a + "g_proj.weight": (nh * vd, H), a + "o_proj.weight": (H, nh * vd)})
        if l < cfg.first_k_dense_replace:
            for n, s in (("gate", (cfg.intermediate_size, H)), ("up", (cfg.intermediate_size, H)),
                         ("down", (H, cfg.intermediate_size))):
                shapes[pre + f"mlp.{n}_proj.weight"] = s
        else:
            m = pre + "block_sparse_moe."
            E, F, Lt = cfg.num_experts, cfg.moe_intermediate_size, cfg.routed_expert_hidden_size
            S = cfg.num_shared_experts * F
            shapes.update({m + "gate.weight": (E, H), m + "routed_expert_down_proj.weight": (Lt, H),
                           m + "routed_expert_norm.weight": (Lt,),
                           m + "routed_expert_up_proj.weight": (H, Lt),
                           m + "experts.w1": (E, F, Lt), m + "experts.w3": (E, F, Lt),
                           m + "experts.w2": (E, Lt, F),
                           m + "shared_experts.gate_proj.weight": (S, H),
                           m + "shared_experts.up_proj.weight": (S, H),
                           m + "shared_experts.down_proj.weight": (H, S)})
    root = nn.Module()
    for name, shape in shapes.items():
        *path, leaf = name.split(".")
        mod = root
        for part in path:
            if not hasattr(mod, part):
                mod.add_module(part, nn.Module())
            mod = getattr(mod, part)
        mod.register_parameter(leaf, nn.Parameter(torch.randn(*shape) * 0.02))
    root.config = cfg
    return root


@pytest.fixture(scope="module")
def cfg():
    return get_preset("nano")


def _group_of(groups):
    return {n: g["name"] for g in groups for n in g["param_names"]}


def test_param_groups_send_each_name_to_the_right_optimizer(cfg):
    model = _fake_model(cfg)
    groups = build_param_groups(model, cfg, lr=1e-3, weight_decay=0.1, muon="per_head")
    where = _group_of(groups)
    assert set(where) == {n for n, _ in model.named_parameters()}
    d = cfg.linear_attn_config.head_dim
    qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    kv = cfg.qk_nope_head_dim + cfg.v_head_dim
    kda, mla = cfg.kda_layer_ids[0], cfg.mla_layer_ids[0]
    expect = {
        f"model.layers.{kda}.self_attn.q_proj.weight": f"muon_per_head[rows={d}]",
        f"model.layers.{kda}.self_attn.v_proj.weight": f"muon_per_head[rows={d}]",
        f"model.layers.{mla}.self_attn.q_b_proj.weight": f"muon_per_head[rows={qk}]",
        f"model.layers.{mla}.self_attn.kv_b_proj.weight": f"muon_per_head[rows={kv}]",
        f"model.layers.{mla}.self_attn.q_a_proj.weight": "muon",
        f"model.layers.{kda}.self_attn.o_proj.weight": "muon",
        f"model.layers.{kda}.self_attn.b_proj.weight": "muon",
        "model.layers.0.mlp.gate_proj.weight": "muon",
        "model.layers.1.block_sparse_moe.shared_experts.gate_proj.weight": "muon",
        "model.layers.1.block_sparse_moe.experts.w1": "muon_experts",
        "model.layers.1.block_sparse_moe.experts.w2": "muon_experts",
        "model.layers.1.block_sparse_moe.gate.weight": "adamw",
        "model.embed_tokens.weight": "adamw", "lm_head.weight": "adamw",
        f"model.layers.{kda}.self_attn.q_conv1d.weight": "adamw",
        f"model.layers.{kda}.self_attn.A_log": "adamw_no_decay",
        f"model.layers.{kda}.self_attn.dt_bias": "adamw_no_decay",
        f"model.layers.{kda}.self_attn.o_norm.weight": "adamw_no_decay",
        "model.layers.2.self_attention_res_proj.weight": "adamw_no_decay",
        "model.output_attn_res_proj.weight": "adamw_no_decay",
        "model.layers.1.block_sparse_moe.routed_expert_norm.weight": "adamw_no_decay",
        "model.norm.weight": "adamw_no_decay",
    }
    for name, group in expect.items():
        assert where[name] == group, name
    by_name = {g["name"]: g for g in groups}
    assert by_name["adamw_no_decay"]["weight_decay"] == 0.0 and by_name["adamw"]["weight_decay"] == 0.1
    assert all(g["use_muon"] == g["name"].startswith("muon") for g in groups)
    text = describe_param_groups(groups)
    total = sum(p.numel() for p in model.parameters())
    assert f"{total:,}" in text and "muon_experts" in text


def test_full_and_adamw_only_modes(cfg):
    model = _fake_model(cfg)
    full = _group_of(build_param_groups(model, cfg, muon=True))
    kda = cfg.kda_layer_ids[0]
    assert full[f"model.layers.{kda}.self_attn.q_proj.weight"] == "muon"
    assert full["model.layers.1.block_sparse_moe.experts.w3"] == "muon_experts"
    adam = build_param_groups(model, cfg, muon=False)
    assert not any(g["use_muon"] for g in adam)
    with pytest.raises(ValueError, match="muon"):
        build_param_groups(model, cfg, muon="sometimes")


def test_per_head_rows_must_divide_the_projection(cfg):
    bad = torch.zeros(cfg.linear_attn_config.head_dim * 2 + 1, 8)
    with pytest.raises(ValueError, match="heads of"):
        classify_param(f"model.layers.{cfg.kda_layer_ids[0]}.self_attn.k_proj.weight", bad, cfg)


def test_adamw_groups_match_torch_adamw():
    torch.manual_seed(4)
    w = torch.randn(10, 3)
    p1, p2 = nn.Parameter(w.clone()), nn.Parameter(w.clone())
    mine = Muon([dict(params=[p1], use_muon=False)], lr=0.01, weight_decay=0.1, betas=(0.9, 0.95))
    ref = torch.optim.AdamW([p2], lr=0.01, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8)
    for _ in range(5):
        g = torch.randn(10, 3)
        p1.grad, p2.grad = g.clone(), g.clone()
        mine.step()
        ref.step()
    torch.testing.assert_close(p1.data, p2.data, rtol=1e-6, atol=1e-7)


def _grads(model, seed):
    gen = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=gen)


def test_state_dict_round_trip_gives_identical_next_steps(cfg):
    torch.manual_seed(5)
    model = _fake_model(cfg)
    opt = build_optimizer(model, cfg, lr=1e-3, weight_decay=0.1)
    for s in range(2):
        _grads(model, s)
        opt.step()
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    twin = copy.deepcopy(model)
    for s in (2, 3):
        _grads(model, s)
        opt.step()
    buf.seek(0)
    ck = torch.load(buf)
    twin.load_state_dict(ck["model"])
    opt2 = build_optimizer(twin, cfg, lr=1e-3, weight_decay=0.1)
    opt2.load_state_dict(ck["opt"])
    for s in (2, 3):
        _grads(twin, s)
        opt2.step()
    for (n, a), (_, b) in zip(model.named_parameters(), twin.named_parameters()):
        assert torch.equal(a, b), n


def _mla_max_logits(cfg, q_b, kv_b, cq, ckv, k_pe):
    """Max pre-softmax score per head of the naive MLA score, written from SPEC §3.2."""
    nh, nope, rope, vd = (cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim,
                          cfg.v_head_dim)
    q = (cq @ q_b.t()).view(-1, nh, nope + rope)
    kv = (ckv @ kv_b.t()).view(-1, nh, nope + vd)
    s = (torch.einsum("thd,shd->hts", q[..., :nope], kv[..., :nope])
         + torch.einsum("thd,sd->hts", q[..., nope:], k_pe)) / math.sqrt(nope + rope)
    return s.flatten(1).max(dim=1).values


def test_qk_clip_caps_each_heads_max_logit_at_tau(cfg):
    torch.manual_seed(6)
    model = _fake_model(cfg)
    mla = cfg.mla_layer_ids[0]
    attn = model.model.layers[mla].self_attn if isinstance(model.model.layers, nn.ModuleList) \
        else getattr(model.model.layers, str(mla)).self_attn
    with torch.no_grad():
        attn.q_b_proj.weight.normal_(0, 1.0)
        attn.kv_b_proj.weight.normal_(0, 1.0)
    kv_before = attn.kv_b_proj.weight.detach().clone()
    cq, ckv = torch.randn(12, cfg.q_lora_rank), torch.randn(12, cfg.kv_lora_rank)
    k_pe = torch.randn(12, cfg.qk_rope_head_dim)
    before = _mla_max_logits(cfg, attn.q_b_proj.weight, attn.kv_b_proj.weight, cq, ckv, k_pe).detach()
    tau = float(before.min() + before.max()) / 2  # one head above τ, one below (nano: 2 heads)
    eta = qk_clip_(model, tau, {mla: before}, cfg)[mla]
    after = _mla_max_logits(cfg, attn.q_b_proj.weight, attn.kv_b_proj.weight, cq, ckv, k_pe)
    torch.testing.assert_close(after, torch.minimum(before, torch.tensor(tau)), rtol=1e-4, atol=1e-4)
    assert eta.min() < 1 and eta.max() == 1
    vd = cfg.v_head_dim
    kv_after = attn.kv_b_proj.weight.detach().view(cfg.num_attention_heads, -1, cfg.kv_lora_rank)
    assert torch.equal(kv_after[:, -vd:], kv_before.view_as(kv_after)[:, -vd:])  # v rows kept
