"""Per-Head Muon grouping on the real models (nano, and k3 on the meta device), from SPEC §5.

The expected class of every parameter is written here from the SPEC's list, by the parameter's
role, independently of the optimizer's regular expressions:
  per-head Muon  KDA q/k/v_proj (rows = head_dim); MLA q_b_proj (rows = nope + rope) and kv_b_proj
                 (a head's k_nope and v rows together: rows = nope + v)
  per-expert     routed experts w1, w2, w3
  full Muon      every other 2-D hidden matrix
  AdamW (decay)  embeddings, lm_head, router gate, short-conv weights
  AdamW (no wd)  norms, biases, AttnRes pseudo-queries, A_log, dt_bias
"""

from __future__ import annotations

import pytest
import torch

from k3.config import get_preset
from k3.model.decoder import K3ForCausalLM
from k3.model.summary import build_meta_model
from k3.train.optim import build_param_groups

PER_HEAD_KDA = ("q_proj", "k_proj", "v_proj")
ADAMW_DECAY = ("embed_tokens", "lm_head", "gate", "q_conv1d", "k_conv1d", "v_conv1d")


def expected_class(name: str, cfg) -> tuple[str, int | None]:
    """(class, rows per head) of parameter ``name`` by its role (module docstring)."""
    parts = name.split(".")
    leaf, owner = parts[-1], parts[-2]
    if leaf in ("A_log", "dt_bias", "bias") or "norm" in owner or owner.endswith("_res_proj"):
        return "adamw_no_decay", None
    if owner in ADAMW_DECAY:
        return "adamw", None
    if owner == "experts":
        return "muon_experts", None
    if owner in PER_HEAD_KDA and parts[1] == "layers" and cfg.is_kda_layer(int(parts[2])):
        return "muon_per_head", cfg.linear_attn_config.head_dim
    if owner in ("q_b_proj", "q_proj"):                     # MLA query (with or without q LoRA)
        return "muon_per_head", cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    if owner == "kv_b_proj":
        return "muon_per_head", cfg.qk_nope_head_dim + cfg.v_head_dim
    return "muon", None


def classes_of(model, cfg) -> dict[str, tuple[str, int | None]]:
    out = {}
    for g in build_param_groups(model, cfg):
        kind = g["name"].split("[")[0]
        assert g["use_muon"] == kind.startswith("muon")
        assert g["weight_decay"] == (0.0 if kind == "adamw_no_decay" else 0.1)
        for n in g["param_names"]:
            out[n] = (kind, g["block_rows"])
    return out


@pytest.fixture(scope="module")
def k3_meta():
    cfg = get_preset("k3")
    return cfg, build_meta_model(cfg)


@pytest.mark.parametrize("preset", ["nano", "k3"])
def test_every_parameter_is_in_its_spec_class(preset, k3_meta):
    cfg, model = k3_meta if preset == "k3" else (get_preset("nano"), None)
    model = model if model is not None else K3ForCausalLM(cfg)
    got = classes_of(model, cfg)
    names = [n for n, _ in model.named_parameters()]
    assert sorted(got) == sorted(names)                    # every parameter once
    wrong = {n: (got[n], expected_class(n, cfg)) for n in names if got[n] != expected_class(n, cfg)}
    assert not wrong


def test_k3_class_counts_are_exact(k3_meta):
    # k3: 93 layers = 69 KDA + 24 MLA; 92 MoE layers + 1 dense; full-rank KDA gate, q LoRA, MLA
    # output gate, latent MoE with its norm, AttnRes on, lm_head untied.
    cfg, model = k3_meta
    got = classes_of(model, cfg)
    count = {}
    for kind, rows in got.values():
        count[(kind, rows)] = count.get((kind, rows), 0) + 1
    assert count == {
        ("muon_per_head", 128): 69 * 3,                  # KDA q, k, v
        ("muon_per_head", 192): 24,                      # MLA q_b_proj: 128 nope + 64 rope rows
        ("muon_per_head", 256): 24,                      # MLA kv_b_proj: 128 k_nope + 128 v rows
        ("muon_experts", None): 92 * 3,                  # w1, w3, w2
        # KDA f_a, f_b, b, g, o (5) · 69 + MLA q_a, kv_a_with_mqa, g, o (4) · 24
        # + MoE latent down/up + shared gate/up/down (5) · 92 + dense gate/up/down (3)
        ("muon", None): 69 * 5 + 24 * 4 + 92 * 5 + 3,
        # embed + lm_head + 3 convs · 69 + router gate · 92
        ("adamw", None): 2 + 69 * 3 + 92,
        # KDA A_log, dt_bias, o_norm (3) · 69 + MLA q_a/kv_a norms (2) · 24 + per layer 2 norms,
        # 2 pseudo-queries, 2 key norms (6) · 93 + routed_expert_norm · 92 + final norm and the
        # output pseudo-query + key norm (3)
        ("adamw_no_decay", None): 69 * 3 + 24 * 2 + 93 * 6 + 92 + 3,
    }


def test_router_and_pseudo_queries_stay_on_adamw_in_every_muon_mode():
    cfg = get_preset("nano")
    model = K3ForCausalLM(cfg)
    for mode in ("per_head", "full"):
        groups = {n: g for g in build_param_groups(model, cfg, muon=mode) for n in g["param_names"]}
        router = "model.layers.1.block_sparse_moe.gate.weight"
        assert not groups[router]["use_muon"] and groups[router]["weight_decay"] > 0
        pq = "model.layers.0.self_attention_res_proj.weight"
        assert not groups[pq]["use_muon"] and groups[pq]["weight_decay"] == 0
        # positive control: a hidden matrix of the same layer is on Muon
        assert groups["model.layers.1.block_sparse_moe.routed_expert_down_proj.weight"]["use_muon"]
    full = classes_of_mode(model, cfg, "full")
    assert all(kind != "muon_per_head" for kind, _ in full.values())


def classes_of_mode(model, cfg, mode):
    return {n: (g["name"].split("[")[0], g["block_rows"])
            for g in build_param_groups(model, cfg, muon=mode) for n in g["param_names"]}


def test_one_step_on_nano_updates_each_class_by_its_rule():
    # First step, momentum μ: buf = g, Nesterov u = g + μ·buf = (1 + μ) g. Written out here:
    # per-head blocks and full matrices by an fp64 Newton–Schulz (test_optim.ref_ns), the router
    # by AdamW's first step (m̂ = g, v̂ = g²: the update is lr·g/(|g| + eps)).
    import math

    from test_optim import ref_ns  # same folder (pytest puts it on sys.path)

    from k3.train.optim import build_optimizer

    torch.manual_seed(0)
    cfg = get_preset("nano")
    model = K3ForCausalLM(cfg)
    x = torch.randint(0, cfg.vocab_size, (2, 16))
    model(x, labels=x).loss.backward()
    lr, wd, mu = 0.01, 0.1, 0.95
    params = dict(model.named_parameters())
    names = {"kv_b": "model.layers.3.self_attn.kv_b_proj.weight",
             "kda_q": "model.layers.0.self_attn.q_proj.weight",
             "o": "model.layers.0.self_attn.o_proj.weight",
             "router": "model.layers.1.block_sparse_moe.gate.weight"}
    before = {k: params[n].detach().clone() for k, n in names.items()}
    grads = {k: params[n].grad.clone() for k, n in names.items()}
    build_optimizer(model, cfg, lr=lr, weight_decay=wd, momentum=mu, ns_dtype=torch.float32).step()  # vs fp64 NS

    def muon(w, g, rows=None):
        u = (1 + mu) * g
        rows = rows or u.shape[0]
        blocks = [ref_ns(b) for b in u.split(rows)]
        return w * (1 - lr * wd) - lr * 0.2 * math.sqrt(max(rows, u.shape[1])) * torch.cat(blocks)

    want = {"kv_b": muon(before["kv_b"], grads["kv_b"], cfg.qk_nope_head_dim + cfg.v_head_dim),
            "kda_q": muon(before["kda_q"], grads["kda_q"], cfg.linear_attn_config.head_dim),
            "o": muon(before["o"], grads["o"]),
            "router": before["router"] * (1 - lr * wd)
            - lr * grads["router"] / (grads["router"].abs() + 1e-8)}
    for k, n in names.items():
        torch.testing.assert_close(params[n].detach(), want[k], rtol=1e-4, atol=2e-5, msg=k)
    # control: the per-head rule is distinguishable from full-matrix Muon on these tensors
    for k in ("kv_b", "kda_q"):
        assert not torch.allclose(params[names[k]].detach(), muon(before[k], grads[k]), atol=1e-4), k
