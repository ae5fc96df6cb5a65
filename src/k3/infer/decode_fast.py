"""The decode step over prepared weights (``k3.infer.decode_prep``): the math of
``k3.infer.decode_step.decode_forward`` (same inputs, same outputs) in few calls.

On CPU a decode step at small batch is bound by per-call overhead and by reading the weights, so
each sublayer is as few calls as it can be (B rows, H hidden; n(x) = x / rms(x), the norm weight
being in W):

    KDA   one C call (``k3.ops.decode_layers``): y = n(x) W_in;  h = SiLU(Σ_k w_k [conv | qkv]_k);
          q, k = l2(h_q)/√d, l2(h_k);  e = exp(lb·σ(a·dt + f_a a·W_fb));  S' = e ⊙ S;
          u = β (v − kᵀS');  S = S' + k uᵀ;  out = res + (o·rms⁻¹(o) ⊙ σ(gate)) W_o   (o = qᵀS)
    MLA   one C call: y = n(x) W_in;  [q_lat | q_pe] = n(q_a) W_q  (W_UK and the scale absorbed)
          s = [q_lat cᵀ + q_pe k_peᵀ over the row's own cached length | self];
          o = (softmax(s) [c; c_new]) W_UV ⊙ σ(g)
    MoE   one C call: [logits | z | g_s | u_s] = n(x) W_in;  top-k of σ(logits) + bias, p
          renormalized;  all N·k slots at once: h = act(z_slot [w1|w3]_e) · p, then h w2_e, summed
          over each token's k slots;  out = res + n(u) W_up + act(g_s, u_s) W_sd
    AttnRes mix of n sources: α = softmax(rms⁻¹(v) · (v (γ ⊙ w))),  Σ α v   (one C call)

Every matrix product with a weight is one call of the packed kernel (``k3.ops.packed_mm``), so a
row's result does not depend on the rows beside it. Nothing here writes the cache (the caller
appends the MLA latents and stores the KDA tensors). Equal to the module path within float
rounding: ``tests/infer/test_decode_fast.py``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from k3.infer.decode_prep import (PreparedAct, PreparedKDA, PreparedMLA, PreparedMLP, PreparedMoE,
                                  norm_const)
from k3.model.moe import LatentMoE
from k3.ops.decode_layers import kda_layer_step, mla_layer_step, moe_layer_step
from k3.ops.decode_rows import attn_res_mix_c
from k3.ops.packed_mm import PackedMatrix

__all__ = ["DecodePlan", "fast_forward", "kda_step", "mla_step", "moe_step", "mlp_step"]


def kda_step(p: PreparedKDA, x, res, conv, S, in_place: bool = False):
    """x [B,H] (pre-norm), res [B,H] | None, conv [B,3P,K−1], S [B,nh,d,d] fp32 ->
    (res + out [B,H], conv', S'): one C call (``k3.ops.decode_layers``; ``in_place``: S' over S)."""
    return kda_layer_step(p.c, x, res, conv, S, in_place)


def mla_step(p: PreparedMLA, x, res, c_buf, pe_buf, lengths):
    """x [B,H], c_buf [B,S,r], pe_buf [B,S,p] (row b's first lengths[b] tokens valid) ->
    (res + out [B,H], c_new [B,r], pe_new [B,p]): one C call."""
    return mla_layer_step(p.c, x, res, c_buf, pe_buf, lengths)


def mlp_step(p: PreparedMLP, x, res):
    """The dense gated MLP: res + act(n(x) W_g, n(x) W_u) W_d."""
    h = p.act(*p.w_in.mm(x, norm_c=p.c_in).chunk(2, 1))
    return p.w_down.mm(h, res)


def moe_step(p: PreparedMoE, x, res):
    """x [N,H] (pre-norm), res [N,H] | None -> res + LatentMoE(norm(x)): one C call."""
    return moe_layer_step(p.c, x, res)


class _Layer:
    def __init__(self, layer, act):
        self.is_kda = layer.is_kda
        prep = PreparedKDA if layer.is_kda else PreparedMLA
        self.attn = prep(layer.self_attn, layer.input_layernorm)
        moe = getattr(layer, "block_sparse_moe", None)
        post = layer.post_attention_layernorm
        if isinstance(moe, LatentMoE):
            self.ffn, self.ffn_step = PreparedMoE(moe, post, act), moe_step
        else:
            self.ffn, self.ffn_step = PreparedMLP(layer.mlp, post, act), mlp_step
        if layer.attn_res:
            self.mix_attn = _fold(layer, "self_attention_res")
            self.mix_mlp = _fold(layer, "mlp_res")


def _fold(owner, prefix: str) -> tuple[torch.Tensor, float]:
    """(√H γ ⊙ w, H·eps) of one AttnRes pseudo-query / key-norm pair."""
    norm = getattr(owner, f"{prefix}_norm")
    H = norm.weight.shape[0]
    q = norm.weight.detach() * getattr(owner, f"{prefix}_proj").weight.detach().reshape(-1) * H ** 0.5
    return q, norm_const(norm, H)


class DecodePlan:
    """Every decode weight of ``model`` prepared once (``k3.infer.decode_prep``): a snapshot, to be
    rebuilt when ``WeightWatch(model).key()`` changes (``DecodeStep.plan`` does)."""

    def __init__(self, model):
        with torch.no_grad():
            cfg, m = model.config, model.model
            act = PreparedAct(cfg)
            self.block = cfg.attn_res_block_size
            self.embed = m.embed_tokens.weight
            self.layers = [_Layer(layer, act) for layer in m.layers]
            if self.block is not None:
                self.mix_out = _fold(m, "output_attn_res")
            H = cfg.hidden_size
            self.c_norm = norm_const(m.norm, H)
            self.w_lm = PackedMatrix((model.lm_head.weight.detach() * (m.norm.weight.detach() * H ** 0.5)).t())


def fast_forward(plan: DecodePlan, tokens, lengths, convs, states, c_bufs, pe_bufs, in_place: bool = False):
    """``decode_forward``'s contract over a ``DecodePlan`` (``lengths``: the MLA tokens each row
    holds; its buffers may be longer). Returns (logits [B, V], convs', states', c_new, pe_new).
    ``in_place``: each KDA state' is written over its state (``kda_layer_step``), which the caller
    must own: nothing else may hold it."""
    new_conv, new_S, new_c, new_pe = [], [], [], []
    it_kda, it_mla = iter(zip(convs, states)), iter(zip(c_bufs, pe_bufs))

    def attn(L, h, res):
        if L.is_kda:
            out, conv, S = kda_step(L.attn, h, res, *next(it_kda), in_place)
            new_conv.append(conv), new_S.append(S)
        else:
            out, c, pe = mla_step(L.attn, h, res, *next(it_mla), lengths)
            new_c.append(c), new_pe.append(pe)
        return out

    x = F.embedding(tokens, plan.embed)                                          # [B, H]
    if plan.block is None:
        for L in plan.layers:
            x = attn(L, x, x)
            x = L.ffn_step(L.ffn, x, x)
    else:
        blocks, partial = [], x
        for l, L in enumerate(plan.layers):
            if l % plan.block == 0:
                blocks.append(partial)
                partial = None
            h = attn_res_mix_c(*L.mix_attn, blocks if partial is None else blocks + [partial])
            partial = attn(L, h, partial)
            h = attn_res_mix_c(*L.mix_mlp, blocks + [partial])
            partial = L.ffn_step(L.ffn, h, partial)
        x = attn_res_mix_c(*plan.mix_out, blocks + [partial])
    logits = plan.w_lm.mm(x, norm_c=plan.c_norm)
    return logits, new_conv, new_S, new_c, new_pe
