"""Decode weights prepared once: a backend of the model's own decode step, owned by the engine.

``model(tokens [B, 1], cache, prepared=P)`` runs the one forward (``k3.model.decoder``): the same
layers, the same AttnRes block loop, the same cache updates. With ``P`` (a ``PreparedModel``) each
sublayer's math goes to its prepared form instead of the module's torch ops, on [B, H] rows of
fp32 weights copied once into the shape the CPU kernels read:

    attention  res + KDA(n(x)) / res + MLA(n(x))  one C call each (``k3.ops.decode_layers``),
               writing the layer's cache entry (KDA state, MLA latents appended)
    MoE / MLP  res + LatentMoE(n(x)) one C call;  res + act(n(x) W_g, n(x) W_u) W_d (packed mm)
    AttnRes    α = softmax(rms⁻¹(v) · (v (γ ⊙ w))),  Σ α v   one C call (``attn_res_mix_c``)
    lm_head    one packed matmul

On CPU a decode step at small batch is bound by per-call overhead and by reading the weights; the
module path's ~3,000 small kernels per step become a few per layer. The prepared forms are tested
against the module path (``tests/infer/test_prepared.py``: every sublayer and whole steps within
1e-5 of their scale, the same greedy tokens).

What is folded, per layer (x: the sublayer's input row, n(x) = x / rms(x) without its weight):

* a pre-norm's weight γ into the columns of every projection reading it: W(γ ⊙ n(x)) = (W diag γ) n(x);
  the projections reading one input are stacked by rows into one matrix (one matmul, which also
  applies n to its product);
* KDA: the decay's exp(A_log) into f_b's rows (a·(f + dt) = (diag a W_fb) f_a + a·dt, a product
  plus a bias row), the output norm's weight into o_proj's columns;
* MLA: W_UK and the softmax scale into the query (q_lat_h = (W_UKᵀ_h W_qb,nope_h) q_a, one matrix
  for all heads, the rope part beside it);
* gated activations: SiTU's 1/β_lin into the up rows and β·β_lin into the down columns (routed
  experts: also the routed scaling factor), w1|w3 of each expert stacked into one [2F, ℓ] matrix;
  the latent norm's weight into routed_expert_up_proj.

Every matrix is kept as a ``k3.ops.packed_mm.PackedMatrix`` (column panels, multiplied by the
packed kernel; the routed experts as one stack per layer). All copies are inference-only tensors
(never parameters); ``weights_key(model)`` tells when any source changed (``data_ptr`` /
``_version`` / dtype of every parameter and buffer) and the preparation must be redone. Equal to
the module path up to float rounding (tested to 1e-5).
"""

from __future__ import annotations

import torch
from torch import nn

from k3.errors import K3Error
from k3.model.cache import KDAState, MLAState
from k3.model.mlp import GatedMLP
from k3.model.moe import LatentMoE, RoutedExperts
from k3.ops.backend import c_unavailable, mode as kernels_mode
from k3.ops.decode_layers import (KDALayer, MLALayer, MoELayer, kda_layer_step, mat, mla_layer_step,
                                  moe_layer_step, ptr)
from k3.ops.decode_rows import attn_res_mix_c, gated_act_c
from k3.ops.norm import rms_norm_inference
from k3.ops.packed_mm import PackedMatrix

__all__ = ["MAX_PREPARED_BYTES", "WeightWatch", "weights_key", "prepare_unsupported", "norm_const", "accepts",
           "PreparedAct", "PreparedKDA", "PreparedMLA", "PreparedMLP", "PreparedMoE", "PreparedLayer",
           "PreparedModel", "PreparedWeights"]


class WeightWatch:
    """Tells cheaply whether anything a preparation was built from changed: ``key()`` lists every
    module's parameters and buffers (``data_ptr``, ``_version``: an in-place update, a ``.data``
    swap, a cast or ``load_state_dict``) and the identity of its submodules (a replaced layer),
    walking the module dicts captured once (so a step costs one pass over them, not a recursion)."""

    def __init__(self, model):
        mods = list(model.modules())
        self.tensor_dicts = [d for m in mods for d in (m._parameters, m._buffers)]
        self.module_dicts = [m._modules for m in mods]

    def key(self) -> tuple:
        ts = [t for d in self.tensor_dicts for t in d.values() if t is not None]
        return ([t.data_ptr() for t in ts], [t._version for t in ts],
                [id(v) for d in self.module_dicts for v in d.values()])


def weights_key(model) -> tuple:
    """``WeightWatch(model).key()``: changes on any in-place update or swap of a weight or buffer."""
    return WeightWatch(model).key()


def _plain(*mods) -> bool:
    return all(type(m) is nn.Linear and m.bias is None for m in mods)


MAX_PREPARED_BYTES = 8 << 30   # the preparation copies the weights: refused above this (module path)


def prepare_unsupported(model, max_bytes: int | None = None) -> str | None:
    """Why the prepared step cannot serve ``model`` (None when it can): fp32 weights on the CPU
    (the path this project measures and tests), at most ``max_bytes`` of them (default
    ``MAX_PREPARED_BYTES``: the preparation is a second copy), plain bias-free ``nn.Linear``
    projections, plain dropless routed experts, no group-limited routing, and the packed matmul kernel
    built for this machine and not turned off (``k3.ops.backend.c_unavailable``). (Statistics are not
    a model setting: a forward given ``stats`` with prepared weights is refused by ``K3Model.forward``.)"""
    cfg = model.config
    params = list(model.parameters())
    if any(p.dtype != torch.float32 for p in params):
        return "weights are not all fp32"
    if any(p.device.type != "cpu" for p in params):
        return "weights are not on the CPU"
    limit = MAX_PREPARED_BYTES if max_bytes is None else max_bytes
    size = sum(p.numel() * p.element_size() for p in params)
    if size > limit:
        return f"weights take {size} bytes, more than the {limit} a prepared copy may"
    if cfg.hidden_act not in ("situ", "silu"):
        return f"hidden_act {cfg.hidden_act!r}"
    for i, layer in enumerate(model.model.layers):
        mods = [m for m in layer.modules() if isinstance(m, nn.Linear)]
        if not _plain(*mods):
            return f"layer {i}: a projection is not a plain bias-free nn.Linear"
        moe = getattr(layer, "block_sparse_moe", None)
        if isinstance(moe, LatentMoE):
            if type(moe.experts) is not RoutedExperts:
                return f"layer {i}: routed experts are {type(moe.experts).__name__}"
            if moe.gate.num_groups > 1 or moe.dispatcher is not None:
                return f"layer {i}: group-limited routing or a custom dispatcher"
            if moe.capacity_factor is not None:
                return f"layer {i}: MoE capacity_factor={moe.capacity_factor} (the prepared MoE is dropless)"
        elif not isinstance(getattr(layer, "mlp", None), GatedMLP):
            return f"layer {i}: the dense MLP is {type(getattr(layer, 'mlp', None)).__name__}"
    if not _plain(model.lm_head):
        return "lm_head is not a plain bias-free nn.Linear"
    return c_unavailable()


class PreparedAct:
    """The gated activation with its constants moved into the weights: ``up_scale`` multiplies
    the up rows, ``down_scale`` the down columns; ``__call__(g, u')`` gives act(g, u) / down_scale."""

    def __init__(self, config):
        self.silu = config.hidden_act == "silu"
        beta, lin = config.activation_situ_beta, config.activation_situ_linear_beta
        self.inv_beta = 1.0 if self.silu else 1.0 / beta
        self.tanh_up = not self.silu and lin is not None
        self.up_scale = 1.0 / lin if self.tanh_up else 1.0
        self.down_scale = 1.0 if self.silu else beta * (lin if self.tanh_up else 1.0)

    def __call__(self, g: torch.Tensor, u: torch.Tensor, row_w: torch.Tensor | None = None) -> torch.Tensor:
        """act(g, u) / down_scale (· row_w per row): one C call (``k3.ops.decode_rows.gated_act_c``)."""
        return gated_act_c(g, u, self.silu, self.inv_beta, self.tanh_up, row_w)


def norm_const(norm, dim: int) -> float:
    """The RMSNorm in the form (Σx² + D·eps)^(-1/2) (√D goes into the weights): D·eps."""
    return float(dim * norm.eps)


def _stack_t(*ws: torch.Tensor) -> PackedMatrix:
    """[ΣO, I] stacked rows, packed as its transpose [I, ΣO] (x @ it = [x W_1ᵀ | …])."""
    return PackedMatrix(torch.cat([w.detach() for w in ws], 0).t())


def _packed_t(w: torch.Tensor) -> PackedMatrix:
    """A [O, I] weight packed as [I, O] (x @ it = x Wᵀ)."""
    return PackedMatrix(w.detach().t())


class PreparedKDA:
    def __init__(self, attn, norm):
        a = attn
        nh, d = a.num_heads, a.head_dim
        P = nh * d
        H = a.hidden_size
        self.nh, self.d, self.P = nh, d, P
        self.c_in, self.c_o, self.c_qk = norm_const(norm, H), norm_const(a.o_norm, d), 1e-6
        self.full_gate, self.lb = a.use_full_rank_gate, a.gate_lower_bound
        self.neg_a = None
        g_in = a.g_proj if a.use_full_rank_gate else a.g_a_proj
        ins = (a.q_proj, a.k_proj, a.v_proj, a.f_a_proj, a.b_proj, g_in)
        gamma = norm.weight.detach() * H ** 0.5
        self.w_in = _stack_t(*(m.weight * gamma for m in ins))                  # [H, 3P+d+nh+G]
        self.sizes = [3 * P, d, nh, g_in.weight.shape[0]]
        self.conv_w = torch.cat([a.q_conv1d.weight, a.k_conv1d.weight, a.v_conv1d.weight], 0)[:, 0].detach().clone()
        dec = a.A_log.detach().float().exp().repeat_interleave(d)              # a per channel [P]
        dt = a.dt_bias.detach().float()
        if self.lb is not None:   # lb·σ(a·(f + dt)):  a·f + a·dt in one addmm
            self.w_f, self.f_bias = _packed_t(a.f_b_proj.weight.detach() * dec[:, None]), dec * dt
        else:                     # −a·softplus(f + dt)
            self.w_f, self.f_bias, self.neg_a = _packed_t(a.f_b_proj.weight), dt, -dec
        self.w_gb = None if self.full_gate else _packed_t(a.g_b_proj.weight)
        self.q_scale = d ** -0.5                                                # q also gets 1/√d
        self.w_o = _packed_t(a.o_proj.weight.detach() * (a.o_norm.weight.detach().repeat(nh) * d ** 0.5))
        self.c = KDALayer(mat(self.w_in), mat(self.w_f), mat(self.w_gb), mat(self.w_o), ptr(self.conv_w),
                          ptr(self.f_bias), ptr(self.neg_a), nh, d, self.conv_w.shape[1], self.sizes[1],
                          self.sizes[3], 0.0 if self.lb is None else self.lb, self.c_in, self.c_qk, self.q_scale,
                          self.c_o)   # the whole sublayer in one C call (k3.ops.decode_layers)


class PreparedMLA:
    def __init__(self, attn, norm):
        a = attn
        nh, n, p, r, vd = a.num_heads, a.qk_nope_head_dim, a.qk_rope_head_dim, a.kv_lora_rank, a.v_head_dim
        H = a.hidden_size
        self.nh, self.r, self.p, self.vd, self.c_in = nh, r, p, vd, norm_const(norm, H)
        self.c_kv, self.kv_w = norm_const(a.kv_a_layernorm, r), a.kv_a_layernorm.weight.detach() * r ** 0.5
        self.gated, self.lora = a.use_output_gate, a.q_lora_rank is not None
        w = a.kv_b_proj.weight.detach().view(nh, n + vd, r)
        w_uk = w[:, :n]                                                        # [nh, n, r]
        self.w_uv_t = w[:, n:].transpose(1, 2).contiguous()                    # [nh, r, v]
        q_src = (a.q_b_proj if self.lora else a.q_proj).weight.detach().view(nh, n + p, -1)
        absorbed = torch.bmm(w_uk.transpose(1, 2), q_src[:, :n]).reshape(nh * r, -1)  # [nh·r, in]
        w_q = torch.cat([absorbed, q_src[:, n:].reshape(nh * p, -1)], 0) * a.softmax_scale
        gamma = norm.weight.detach() * H ** 0.5
        gate = (a.g_proj.weight * gamma,) if self.gated else ()
        if self.lora:
            ql = a.q_lora_rank
            self.c_q = norm_const(a.q_a_layernorm, ql)
            self.w_q = _packed_t(w_q * (a.q_a_layernorm.weight.detach() * ql ** 0.5))   # [q_lora, nh(r+p)]
            self.w_in = _stack_t(a.q_a_proj.weight * gamma, a.kv_a_proj_with_mqa.weight * gamma, *gate)
            self.sizes = [a.q_lora_rank, r + p] + ([nh * vd] if self.gated else [])
        else:
            self.w_in = _stack_t(w_q * gamma, a.kv_a_proj_with_mqa.weight * gamma, *gate)
            self.sizes = [nh * (r + p), r + p] + ([nh * vd] if self.gated else [])
        self.w_o = _packed_t(a.o_proj.weight)
        self.c = MLALayer(mat(self.w_in), mat(self.w_q if self.lora else None), mat(self.w_o), ptr(self.w_uv_t),
                          ptr(self.kv_w), nh, r, p, vd, self.sizes[0], int(self.gated), self.c_in,
                          self.c_q if self.lora else 0.0, self.c_kv)   # one C call


class PreparedMLP:
    def __init__(self, mlp, norm, act: PreparedAct):
        gamma = norm.weight.detach() * mlp.hidden_size ** 0.5
        self.c_in, self.act, self.F = norm_const(norm, mlp.hidden_size), act, mlp.gate_proj.weight.shape[0]
        self.w_in = _stack_t(mlp.gate_proj.weight * gamma, mlp.up_proj.weight * (gamma * act.up_scale))
        self.w_down = _packed_t(mlp.down_proj.weight.detach() * act.down_scale)


class PreparedMoE:
    def __init__(self, moe: LatentMoE, norm, act: PreparedAct):
        gamma, g = norm.weight.detach() * moe.hidden_size ** 0.5, moe.gate
        self.c_in, self.act, self.k, self.E = norm_const(norm, moe.hidden_size), act, moe.top_k, moe.num_experts
        self.tiny = 1e-20
        self.activation, self.renormalize = g.activation, g.renormalize
        self.bias = g.e_score_correction_bias                                  # live buffer (QB updates it)
        self.latent = moe.latent
        shared = getattr(moe, "shared_experts", None)
        ins = [g.weight * gamma]
        if self.latent:
            ins.append(moe.routed_expert_down_proj.weight * gamma)
        if shared is not None:
            ins += [shared.gate_proj.weight * gamma, shared.up_proj.weight * (gamma * act.up_scale)]
            self.Fs = shared.gate_proj.weight.shape[0]
        self.w_in = _stack_t(*ins)
        self.sizes = [w.shape[0] for w in ins]
        self.shared = shared is not None
        ex = moe.experts
        F_ = ex.w1.shape[1]
        self.F, self.gamma = F_, gamma
        w13 = torch.cat([ex.w1.detach(), ex.w3.detach() * act.up_scale], 1)   # [E, 2F, ℓ]
        w2 = ex.w2.detach() * (act.down_scale * g.scaling)                     # [E, ℓ, F]
        self.w13, self.w2 = PackedMatrix(w13.transpose(1, 2)), PackedMatrix(w2.transpose(1, 2))  # x @ w[e]
        norm_u = getattr(moe, "routed_expert_norm", None)
        ell = ex.w1.shape[2]
        self.c_u = None if norm_u is None else norm_const(norm_u, ell)
        self.w_up = None                                                          # [ℓ, H]: n(u) @ it
        if self.latent:
            up = moe.routed_expert_up_proj.weight.detach()
            self.w_up = _packed_t(up if norm_u is None else up * (norm_u.weight.detach() * ell ** 0.5))
        self.w_sd = _packed_t(shared.down_proj.weight.detach() * act.down_scale) if shared is not None else None
        self.c = MoELayer(mat(self.w_in), mat(self.w13), mat(self.w2), mat(self.w_up), mat(self.w_sd),
                          ptr(self.bias), ptr(self.gamma), self.E, self.k, F_, self.Fs if self.shared else 0,
                          self.w2.N, int(self.activation != "sigmoid"), int(self.renormalize), int(act.silu),
                          int(act.tanh_up), self.tiny, act.inv_beta, self.c_in,
                          -1.0 if self.c_u is None else self.c_u)   # one C call (k3.ops.decode_layers)


def _fold(owner, prefix: str) -> tuple[torch.Tensor, float]:
    """(√H γ ⊙ w, H·eps) of one AttnRes pseudo-query / key-norm pair."""
    norm = getattr(owner, f"{prefix}_norm")
    H = norm.weight.shape[0]
    q = norm.weight.detach() * getattr(owner, f"{prefix}_proj").weight.detach().reshape(-1) * H ** 0.5
    return q, norm_const(norm, H)


def _mix(folded: dict, prefix: str, sources: list[torch.Tensor]) -> torch.Tensor:
    """The AttnRes mix of n [B, H] sources with a folded pair -> [B, H] (one source: itself)."""
    if len(sources) == 1:
        return sources[0]
    q, c = folded[prefix]
    return attn_res_mix_c(q, c, sources)


class PreparedLayer:
    """One decoder layer's prepared sublayers, the backend ``DecoderLayer`` calls in place of its
    modules' math: ``attn(h, res, state)`` = res + mixer(input_layernorm(h)) (res None: the mixer's
    output alone) with ``state`` (the layer's cache entry) advanced by the token, ``ffn(h, res)`` =
    res + ffn(post_attention_layernorm(h)), ``mix(prefix, sources)`` the layer's AttnRes mix; every
    tensor [B, H] (one token per row: ``K3Model.forward`` hands the stream over as rows)."""

    def __init__(self, layer, act: PreparedAct, owner: "PreparedModel"):
        self.is_kda, self.index, self.owner = layer.is_kda, layer.layer_idx, owner
        self.attn_w = (PreparedKDA if layer.is_kda else PreparedMLA)(layer.self_attn, layer.input_layernorm)
        moe = getattr(layer, "block_sparse_moe", None)
        post = layer.post_attention_layernorm
        self.moe = isinstance(moe, LatentMoE)
        self.ffn_w = PreparedMoE(moe, post, act) if self.moe else PreparedMLP(layer.mlp, post, act)
        self.folded = ({p: _fold(layer, p) for p in ("self_attention_res", "mlp_res")} if layer.attn_res else {})

    def attn(self, h: torch.Tensor, res: torch.Tensor | None, state) -> torch.Tensor:
        if self.is_kda:
            if state.conv is None or state.recurrent is None:
                raise K3Error(f"prepared decode, layer {self.index}: the KDA state is not written yet "
                              "(prefill the cache through the model first)")
            out, state.conv, state.recurrent = kda_layer_step(self.attn_w.c, h, res, state.conv, state.recurrent,
                                                              self.owner.in_place_state)
        else:
            if state.is_empty:
                raise K3Error(f"prepared decode, layer {self.index}: the MLA cache is empty "
                              "(prefill the cache through the model first)")
            out, c, pe = mla_layer_step(self.attn_w.c, h, res, state.c, state.k_pe, state.lengths)
            state.append(c[:, None], pe[:, None])
        return out

    def ffn(self, h: torch.Tensor, res: torch.Tensor) -> torch.Tensor:
        if self.moe:
            return moe_layer_step(self.ffn_w.c, h, res)
        p = self.ffn_w
        return p.w_down.mm(p.act(*p.w_in.mm(h, norm_c=p.c_in).chunk(2, 1)), res)

    def mix(self, prefix: str, sources: list[torch.Tensor]) -> torch.Tensor:
        return _mix(self.folded, prefix, sources)


class PreparedModel:
    """Every decode weight of ``model`` prepared once: ``layers[l]`` (``PreparedLayer``), the output
    AttnRes ``mix``, the final ``norm`` and ``lm_head`` — what ``model(tokens, cache, prepared=this)``
    calls. A snapshot:
    ``PreparedWeights`` rebuilds it when ``WeightWatch(model).key()`` changes.

    ``in_place_state``: each KDA layer's new recurrent state is written over the cache's tensor
    instead of a new one (fewer bytes moved at large batch), for a caller that owns its caches, as
    the engine does; otherwise a state tensor taken from the cache before a step keeps its values."""

    def __init__(self, model, in_place_state: bool = False):
        with torch.no_grad():
            cfg, m = model.config, model.model
            act = PreparedAct(cfg)
            self.in_place_state = bool(in_place_state)
            self.layers = [PreparedLayer(layer, act, self) for layer in m.layers]
            self.folded = {"output_attn_res": _fold(m, "output_attn_res")} if cfg.attn_res_block_size else {}
            self.norm_w, self.norm_eps = m.norm.weight.detach(), m.norm.eps
            self.w_lm = _packed_t(model.lm_head.weight)

    def mix(self, prefix: str, sources: list[torch.Tensor]) -> torch.Tensor:
        return _mix(self.folded, prefix, sources)

    def norm(self, x: torch.Tensor) -> torch.Tensor:
        """The final RMSNorm of [B, H] rows in ``rms_norm``'s torch inference form (three ops; the
        module's C op costs more than its math for a few rows)."""
        return rms_norm_inference(x, self.norm_w, self.norm_eps)

    def lm_head(self, h: torch.Tensor) -> torch.Tensor:
        """h [B, T, H] -> logits [B, T, V]."""
        B, T, H = h.shape
        return self.w_lm.mm(h.reshape(B * T, H).contiguous()).view(B, T, -1)


def accepts(cache) -> bool:
    """Every KDA state written and every MLA state non-empty: a cache after its prefill, which the
    prepared step can continue."""
    for s in cache.layers:
        if isinstance(s, KDAState) and (s.conv is None or s.recurrent is None):
            return False
        if isinstance(s, MLAState) and (s._c is None or s.is_empty):
            return False
    return True


class PreparedWeights:
    """The engine's prepared-weights cache: ``current()`` gives the ``PreparedModel`` for the model's
    current values (rebuilt when any weight, buffer, submodule, statistics switch or ``K3_KERNELS``
    changed), or None when the prepared step does not apply (``why``: ``prepare_unsupported``, re-checked whenever
    that key changes)."""

    def __init__(self, model, in_place_state: bool = False):
        self.model, self.in_place_state = model, in_place_state
        self._plan: PreparedModel | None = None
        self._watch: WeightWatch | None = None
        self._key, self.why = None, None

    def current(self) -> PreparedModel | None:
        if self._watch is None:
            self._watch = WeightWatch(self.model)
        key = (self._watch.key(), kernels_mode())
        if key != self._key:
            self._watch = WeightWatch(self.model)    # the module set may have changed
            key = (self._watch.key(), kernels_mode())
            self._key, self.why, self._plan = key, prepare_unsupported(self.model), None
        if self.why is not None:
            return None
        if self._plan is None:
            self._plan = PreparedModel(self.model, self.in_place_state)
        return self._plan
