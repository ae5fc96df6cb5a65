"""Activation bytes of one training micro-batch, from the config alone (docs/PLAN.md §4).

What counts: every tensor autograd holds for the backward pass of ``K3ForCausalLM(ids,
labels=ids)`` once its forward is done (the eager PyTorch path of k3.model / k3.ops), each storage
once, parameters not counted (they are counted as parameters). The terms below follow the op lists of the modules;
``e`` is the activation (compute) dtype's size, ``4`` marks tensors the code keeps in fp32 whatever
the dtype (norms, gates, the KDA recurrence, the router, SiTU, the AttnRes mix, the loss).

Notation, per micro-batch: B sequences of T tokens, N = B·T; H hidden; KDA nh heads of d, P = nh·d,
conv kernel K; MLA nh_m heads, q rank q_r, latent r, nope n, rope p, value v; MoE k of E experts,
latent ℓ, expert width F, shared width F_s, S = N·k slots; dense MLP width I; vocabulary V.

    rms_norm(D)         = N·(2D + 1)·4                       x (fp32), 1/rms, x/rms
    attn_res_mix(n)     = n·N·(3H + 2)·4                     stacked sources, keys, logits, weights (n ≥ 2)
    glu(M, W)           = M·W·(6·4 + e)                      SiTU: tanh, gate, sigmoid, tanh, up, product; down input
                        = M·W·4·e                            SwiGLU: g, silu(g), u, down input
    kda_core            = B·nh·(n_c·(64·201 + (64c + 1)·d + 4d²) − (5 | 7)·d²)·4    chunk_kda (torch)
                          n_c = ⌈T/64⌉ chunks; 5 when n_c > 1, 7 for one chunk; c = 30 with factorised
                          diagonal blocks (a gate lower bound lb with |lb|·15 ≤ 80), else 43 (diagonal blocks by
                          recursive halving, ``k3.ops.kda._diag_halving``)
    sdpa (math, CPU)    = B·nh_m·T·(2(n+p) + v + T)·4        q, k, v and the T×T probabilities, fp32
    sdpa (fused, CUDA)  = B·nh_m·T·((3n + 2p + v)·e + 4)     q, k, the kv_b output v is a view of, log-sum-exp

With ``kernels="cpu"`` (k3's C ops on the CPU: ``k3::kda_scan`` and ``k3::cross_entropy`` in any
dtype; ``k3::attn_res_mix``, ``k3::short_conv_silu``, ``k3::gated_act`` and ``k3::rms_norm`` for fp32
activations) these terms are what those ops keep instead:

    rms_norm(D) (C)     = N·(D + 1)·4                           x and 1/rms (no x/rms)
    kda_core (C)        = (4·N·P + B·nh·n_c·d²)·4              q, k, v, g (fp32 copies), the state every 64 tokens
    short conv (C)      = (2·N·3P + 3P·K)·4                    input, output (the q/k norms' input), taps [K, 3P]
    attn_res_mix(n) (C) = (3·n·N + H)·4 + N·H·4                 α, 1/‖v‖, ⟨q, v⟩ per row and source, the folded
                                                              query, and the newest source (the running partial
                                                              sum, which no other op keeps)
    glu(M, W) (C)       = M·W·3·4                               g, u, and the product (the down projection's input)
    loss (C)            = N·(V·4 + 8 + 4)                       the logits, targets, log-sum-exp per row

The ``kda_core`` coefficients are the count of the fp32 numbers ``k3.ops.kda.chunk_kda`` still
holds for the backward per chunk and head (the padded chunk, P and A blocks, the blockwise solve,
the chunk's state and transition), at its fixed chunk 64 / sub-chunk 16, less the last chunk's
state update (its graph is dropped when the final state is not returned), for B ≥ 2 (B = 1 holds
1 + d fewer per token and head: two of them are views of its inputs). On CUDA with ``fla``
installed the fused kernel saves far less, so there the figure is the torch path's upper bound.
The ``fused`` SDPA term (CUDA's memory-efficient kernel; flash needs equal q/v head sizes, MLA
has 192 and 128) is derived from what that kernel saves and is not measured by the CPU tests
(CPU SDPA runs the math path).
"""

from __future__ import annotations

import math

__all__ = ["activation_terms", "activation_bytes", "ATTENTION_KINDS", "KERNEL_KINDS"]

ATTENTION_KINDS = ("math", "fused")
KERNEL_KINDS = ("torch", "cpu")
F32 = 4
I64 = 8


def _norm(N: int, D: int, c_op: bool = False) -> int:
    return N * (D + 1) * F32 if c_op else N * (2 * D + 1) * F32


def _mix(n: int, N: int, H: int, c_op: bool = False) -> int:
    if n < 2:
        return 0
    return (3 * n * N + H) * F32 + N * H * F32 if c_op else n * N * (3 * H + 2) * F32


def _glu(cfg, M: int, W: int, e: int, c_op: bool = False) -> int:
    """Gated activation of M rows, width W, and the down projection's input."""
    if c_op:                                        # k3::gated_act keeps g and u; the product is the down input
        return M * W * 3 * F32
    if cfg.hidden_act == "silu":                    # SwiGLU in the compute dtype: g, silu(g), u; product
        return M * W * 4 * e
    return M * W * (6 * F32 + e)                    # SiTU, fp32 inside


def _kda(cfg, B: int, T: int, e: int, kernels: str) -> int:
    lac, N = cfg.linear_attn_config, B * T
    nh, d, K = lac.num_heads, lac.head_dim, lac.short_conv_kernel_size
    P = nh * d
    if kernels == "cpu" and e == F32:
        conv = (2 * N * 3 * P + 3 * P * K) * F32                             # input, output, taps
    else:
        conv = B * 3 * P * (T + K - 1) * e + 3 * P * K * e + 2 * N * 3 * P * e   # conv in, weights, out, SiLU out
    qk_norm = 2 * N * nh * F32                                               # the two 1/‖·‖
    gate_in = N * d * e + 2 * N * P * F32 + N * nh * F32                     # f_a out, decay (2), beta
    chunks = math.ceil(T / 64)
    if kernels == "cpu":
        core = (4 * N * P + B * nh * chunks * d * d) * F32                   # q, k, v, g; a state per chunk
    else:
        factored = lac.gate_lower_bound is not None and abs(lac.gate_lower_bound) * 15 <= 80  # as chunk_kda picks
        c = 30 if factored else 43   # else: recursive halving of the diagonal blocks
        per_chunk = 64 * 201 + (64 * c + 1) * d + 4 * d * d
        core = B * nh * (chunks * per_chunk - (5 if chunks > 1 else 7) * d * d) * F32
    if lac.use_full_rank_gate:
        out_gate = 0
    else:
        out_gate = N * d * e                                                 # g_a out
    o_norm = N * (P + nh) * F32 if kernels == "cpu" and e == F32 else N * (2 * P + nh) * F32
    out = o_norm + 2 * N * P * F32 + N * P * e + out_gate                     # o_norm, sigmoid, product in, o_proj in
    return conv + qk_norm + gate_in + core + out


def _mla(cfg, B: int, T: int, e: int, attention: str, c_norm: bool) -> int:
    N, nh = B * T, cfg.num_attention_heads
    n, p, v, r = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    q = 0 if cfg.q_lora_rank is None else _norm(N, cfg.q_lora_rank, c_norm) + N * cfg.q_lora_rank * e
    x32 = N * (r + p) * F32 if e == F32 else N * r * F32   # fp32: the norm's input is the kv_a output itself
    kv = x32 + N * F32 + (0 if c_norm else N * r * F32) + N * r * e
    if attention == "math":
        sdpa = B * nh * T * (2 * (n + p) + v + T) * F32
    else:
        # memory-efficient / flash SDPA: q (view of q_b's output), k (the cat), v's storage (kv_b's
        # output, n + v per head), log-sum-exp; its output is the gate's input, counted there
        sdpa = B * nh * T * ((2 * (n + p) + n + v) * e + F32)
    gate = 3 * N * nh * v * e if cfg.mla_use_output_gate else N * nh * v * e
    return q + kv + sdpa + gate


def _moe(cfg, N: int, e: int, c_op: bool) -> int:
    H, E, k, F = cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_token, cfg.moe_intermediate_size
    L, S = cfg.expert_dim, N * cfg.num_experts_per_token
    # x fp32 (in fp32 that is the layer's norm output itself, counted with the norm), scores, renorm,
    # weights, ids; the shared experts' input in the compute dtype (in fp32 again the norm output)
    router = (0 if e == F32 else N * H * F32) + N * (E + 1 + k) * F32 + N * k * I64
    shared_in = 0 if e == F32 else N * H * e
    dispatch = 2 * S * I64 + S * F32 + 2 * S * L * F32 + E * 4                # order, token, p, expert out, offsets
    experts = S * L * e + _glu(cfg, S, F, e, c_op)
    latent = 0
    if cfg.uses_latent_moe:
        latent = (_norm(N, L, c_op) if cfg.latent_moe_use_norm else 0) + N * L * e
    shared = _glu(cfg, N, cfg.num_shared_experts * F, e, c_op) if cfg.num_shared_experts else 0
    return router + shared_in + dispatch + experts + latent + shared


def _sources(cfg, layer: int) -> tuple[int, int]:
    """AttnRes sources of the attention and MLP mixes of ``layer`` (SPEC §3.3 bookkeeping)."""
    bs = cfg.attn_res_block_size
    if bs is None:
        return 0, 0
    blocks = layer // bs + 1
    return blocks + (1 if layer % bs else 0), blocks + 1


def layer_bytes(cfg, layer: int, B: int, T: int, e: int, attention: str, kernels: str = "torch") -> int:
    """Saved bytes of decoder layer ``layer`` for a [B, T] micro-batch."""
    N, H = B * T, cfg.hidden_size
    n_attn, n_mlp = _sources(cfg, layer)
    c_mix = kernels == "cpu" and e == F32
    total = _mix(n_attn, N, H, c_mix) + _mix(n_mlp, N, H, c_mix) + 2 * (_norm(N, H, c_mix) + N * H * e)
    total += _kda(cfg, B, T, e, kernels) if cfg.is_kda_layer(layer) else _mla(cfg, B, T, e, attention, c_mix)
    if cfg.is_moe_layer(layer):
        total += _moe(cfg, N, e, c_mix)
    else:
        total += _glu(cfg, N, cfg.intermediate_size, e, c_mix)
    return total


def _head(cfg, B: int, T: int, e: int, kernels: str) -> int:
    """Embedding ids, the output AttnRes mix, final norm, lm_head input, the loss's fp32 [N, V]
    (log-softmax; with the C op its input, the logits: the last position of each row is an ignored
    target, not cut off) and targets."""
    N, H = B * T, cfg.hidden_size
    out_mix = 0
    c_op = kernels == "cpu" and e == F32
    if cfg.attn_res_block_size is not None:
        out_mix = _mix(math.ceil(cfg.num_hidden_layers / cfg.attn_res_block_size) + 1, N, H, c_op)
    loss = N * cfg.vocab_size * F32 + N * I64 + N * F32 if kernels == "cpu" else \
        N * cfg.vocab_size * F32 + N * I64 + F32
    return N * I64 + out_mix + _norm(N, H, c_op) + N * H * e + loss


def activation_terms(cfg, micro_batch: int, seq_len: int, itemsize: int, attention: str = "math",
                     kernels: str = "torch") -> dict:
    """Per-part saved bytes: ``kda_layers``, ``mla_layers``, ``head`` (embedding, output mix, norm, loss),
    ``max_layer`` (the largest single decoder layer), ``layer_inputs`` (what per-layer recomputation keeps:
    each layer's input: its AttnRes partial sum or block, or its residual input)."""
    if attention not in ATTENTION_KINDS:
        raise ValueError(f"attention must be one of {ATTENTION_KINDS}, got {attention!r}")
    if kernels not in KERNEL_KINDS:
        raise ValueError(f"kernels must be one of {KERNEL_KINDS}, got {kernels!r}")
    B, T, e = micro_batch, seq_len, itemsize
    per_layer = [layer_bytes(cfg, l, B, T, e, attention, kernels) for l in range(cfg.num_hidden_layers)]
    kda = sum(b for l, b in enumerate(per_layer) if cfg.is_kda_layer(l))
    N, H, L = B * T, cfg.hidden_size, cfg.num_hidden_layers
    # one new tensor per layer input: the embedding for layer 0, then each layer's output (a block
    # of AttnRes is the last partial sum before it, not a tensor of its own)
    return dict(kda_layers=kda, mla_layers=sum(per_layer) - kda, head=_head(cfg, B, T, e, kernels),
                max_layer=max(per_layer), layer_inputs=L * N * H * e)


def activation_bytes(cfg, micro_batch: int, seq_len: int, itemsize: int, attention: str = "math",
                     kernels: str = "torch") -> dict:
    """``{"full": all saved tensors, "recompute": peak with per-decoder-layer recomputation}``.

    kernels: "torch" (the eager torch ops: CUDA, or a CPU without a compiler) or "cpu" (k3's C ops).

    recompute = layer_inputs + head + max_layer: the checkpointed layers keep only their inputs, and
    the backward of one layer re-runs its forward, holding that layer's saved tensors at a time.
    """
    t = activation_terms(cfg, micro_batch, seq_len, itemsize, attention, kernels)
    return {"full": t["kda_layers"] + t["mla_layers"] + t["head"],
            "recompute": t["layer_inputs"] + t["head"] + t["max_layer"], "terms": t}
