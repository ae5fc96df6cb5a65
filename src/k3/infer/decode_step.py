"""One decode step of the whole model as a pure tensor function over [B, H] rows.

A decode step feeds every row of a ``K3Cache`` one token. Through ``model(tokens, cache)`` that is
~3,000 small kernels (norms, AttnRes mixing, routing, dispatch, shape checks) around the matmuls,
and on CPU their dispatch cost, not the weight reads, bounds the speed. ``DecodeStep`` runs the
same math through the layers' single-token functions (``KimiDeltaAttention.decode_math``,
``GatedMLA.decode_math``, ``LatentMoE.forward_decode``: fused input projections, no sort for a
few routed slots) on [B, H] rows without the [B, T] bookkeeping::

    logits [B, V], conv'_l, S'_l, (c_new, k_pe_new)_m = step(tokens [B], lengths [B],
                                                           conv_l, S_l, c_buf_m, k_pe_buf_m)

for KDA layers l and MLA layers m (``lengths``: tokens cached per row, the new token's position).
Nothing inside writes the cache: the caller stores the new KDA tensors and appends the new MLA
latents (``MLAState.append``) after the call (also what a ``torch.compile`` of the function would
need; on this project's 2-core CPU machine inductor took minutes to compile it, so it is not used).

By default (``prepared=True``) the step runs over weights prepared once (``k3.infer.decode_prep``:
norms, constants and W_UK folded into stacked matrices) through ``k3.infer.decode_fast.fast_forward``,
which has this function's contract; the preparation is rebuilt whenever ``WeightWatch`` sees any
parameter, buffer or submodule change, and models it does not cover (``prepare_unsupported``) use
``decode_forward`` over the modules.

``model(tokens, cache)`` stays the reference: ``tests/infer/test_decode_step.py`` checks the step
against it (logits within 1e-5, identical greedy tokens). ``unsupported``
names why a model or cache cannot take this path (MX or QAT experts, a capacity-factor MoE, max-logit
recording, a fresh or empty state, ...); the engine then uses the eager forward.
"""

from __future__ import annotations

import torch

from k3.infer.decode_fast import DecodePlan, fast_forward
from k3.infer.decode_prep import WeightWatch, prepare_unsupported
from k3.model.cache import K3Cache, KDAState, MLAState
from k3.model.moe import LatentMoE, RoutedExperts
from k3.ops.attn_res import attn_res_mix, attn_res_mix_rows

__all__ = ["DecodeStep", "decode_forward"]


def _ffn(layer, x: torch.Tensor) -> torch.Tensor:
    moe = getattr(layer, "block_sparse_moe", None)
    return layer.mlp(x) if moe is None else moe.forward_decode(x)


def decode_forward(model, tokens, lengths, convs, states, c_bufs, pe_bufs):
    """The step (see module docstring). tokens [B] int64; convs / states: per KDA layer in layer
    order; c_bufs / pe_bufs: per MLA layer. Returns (logits [B, V], convs', states', c_new, pe_new)."""
    m, cfg = model.model, model.config
    new_conv, new_S, new_c, new_pe = [], [], [], []
    it_kda, it_mla = iter(zip(convs, states)), iter(zip(c_bufs, pe_bufs))

    def attn(layer, h):
        if layer.is_kda:
            conv, S = next(it_kda)
            out, conv, S = layer.self_attn.decode_math(h, conv, S)
            new_conv.append(conv), new_S.append(S)
        else:
            c_buf, pe_buf = next(it_mla)
            out, c, pe = layer.self_attn.decode_math(h, c_buf, pe_buf, lengths)
            new_c.append(c), new_pe.append(pe)
        return out

    x = m.embed_tokens(tokens)                                            # [B, H]
    if cfg.attn_res_block_size is None:
        for layer in m.layers:
            x = x + attn(layer, layer.input_layernorm(x))
            x = x + _ffn(layer, layer.post_attention_layernorm(x))
    else:
        def mix(owner, prefix, srcs):
            norm = getattr(owner, f"{prefix}_norm")
            if x.dtype != torch.float32:
                return attn_res_mix(srcs, getattr(owner, f"{prefix}_proj").weight, norm.weight, norm.eps)
            return attn_res_mix_rows(srcs, getattr(owner, f"{prefix}_proj").weight, norm.weight, norm.eps)

        bs, blocks, partial = cfg.attn_res_block_size, [], x
        for l, layer in enumerate(m.layers):
            if l % bs == 0:
                blocks.append(partial)
                partial = None
            srcs = blocks if partial is None else blocks + [partial]
            a = attn(layer, layer.input_layernorm(mix(layer, "self_attention_res", srcs)))
            partial = a if partial is None else partial + a
            h = mix(layer, "mlp_res", blocks + [partial])
            partial = partial + _ffn(layer, layer.post_attention_layernorm(h))
        x = mix(m, "output_attn_res", blocks + [partial])
    logits = model.lm_head(m.norm(x))
    return logits, new_conv, new_S, new_c, new_pe


class DecodeStep:
    """``DecodeStep(model, prepared=True)``; ``step(tokens [B], cache) -> logits [B, V]`` advances
    ``cache`` by one token per row as ``model(tokens[:, None], cache=cache)`` does (same math, fewer
    kernels; ``prepared``: over ``k3.infer.decode_prep``'s prepared weights where they apply).
    Only for a model with ``unsupported(model) is None`` and a cache that ``accepts(cache)``:
    the engine checks both before every step (a model's flags may change between steps).

    ``in_place_state``: the prepared step writes each KDA layer's new recurrent state over the
    cache's tensor instead of a new one (fewer bytes moved at large batch), for a caller that owns
    its caches, as the engine does; by default a state tensor taken from the cache before a step
    keeps its values."""

    def __init__(self, model, prepared: bool = True, in_place_state: bool = False):
        self.model = model
        self.prepared = prepared   # the prepared-weights step (k3.infer.decode_fast) when it applies
        self.in_place_state = in_place_state
        self._plan: DecodePlan | None = None
        self._watch: WeightWatch | None = None
        self._key, self._why = None, None     # the weights' key and prepare_unsupported at that key

    def plan(self) -> DecodePlan | None:
        """The prepared weights for the model's current values (rebuilt when any weight, buffer or
        submodule changed), or None when the prepared step does not apply (``prepare_unsupported``,
        re-checked whenever that key changes)."""
        if not self.prepared:
            return None
        if self._watch is None:
            self._watch = WeightWatch(self.model)
        key = self._watch.key()
        if key != self._key:
            self._watch = WeightWatch(self.model)    # the module set may have changed
            key = self._watch.key()
            self._key, self._why, self._plan = key, prepare_unsupported(self.model), None
        if self._why is not None:
            return None
        if self._plan is None:
            self._plan = DecodePlan(self.model)
        return self._plan

    @staticmethod
    def unsupported(model) -> str | None:
        """Why ``model`` cannot use the step (None when it can)."""
        for i, layer in enumerate(model.model.layers):
            a = layer.self_attn
            if layer.is_kda and not a.fast_decode:
                return f"layer {i}: KDA fast_decode is off"
            if not layer.is_kda and (a.attn_impl == "naive" or a.record_max_logits):
                return f"layer {i}: MLA attn_impl={a.attn_impl!r} / record_max_logits={a.record_max_logits}"
            moe = getattr(layer, "block_sparse_moe", None)
            if isinstance(moe, LatentMoE):
                if moe.capacity_factor is not None or moe.record_router_stats:
                    return f"layer {i}: MoE capacity_factor / record_router_stats set"
                if type(moe.experts) is not RoutedExperts:
                    return f"layer {i}: routed experts are {type(moe.experts).__name__} (MX / QAT)"
        return None

    @staticmethod
    def accepts(cache: K3Cache) -> bool:
        """Every KDA state written and every MLA state non-empty (a cache after its prefill)."""
        for s in cache.layers:
            if isinstance(s, KDAState) and (s.conv is None or s.recurrent is None):
                return False
            if isinstance(s, MLAState) and (s._c is None or s.is_empty):
                return False
        return True

    @torch.no_grad()
    def step(self, tokens: torch.Tensor, cache: K3Cache) -> torch.Tensor:
        kda = [s for s in cache.layers if isinstance(s, KDAState)]
        mla = [s for s in cache.layers if isinstance(s, MLAState)]
        lengths = mla[0].lengths if mla else cache.seq_lens
        plan = self.plan()
        # The math in inference mode (no version counters or view tracking). What leaves it is
        # ordinary already (the C kernels' KDA tensors), copied out (the module path's KDA
        # tensors, the logits) or copied into the MLA buffers by append, outside it: the cache and
        # the logits stay ordinary tensors, which a later in-place op or autograd may use.
        with torch.inference_mode():
            if plan is not None:
                logits, convs, Ss, cs, pes = fast_forward(plan, tokens, lengths, [s.conv for s in kda],
                                                          [s.recurrent for s in kda], [s.c for s in mla],
                                                          [s.k_pe for s in mla], self.in_place_state)
            else:
                logits, convs, Ss, cs, pes = decode_forward(self.model, tokens, lengths,
                                                            [s.conv for s in kda], [s.recurrent for s in kda],
                                                            [s._c for s in mla], [s._k_pe for s in mla])
        for s, conv, S in zip(kda, convs, Ss):  # the C step's outputs are ordinary tensors already
            s.conv = conv.clone() if conv.is_inference() else conv
            s.recurrent = S.clone() if S.is_inference() else S
        for s, c, pe in zip(mla, cs, pes):
            s.append(c[:, None], pe[:, None])
        cache.seq_lens = cache.seq_lens + 1
        return logits.clone()
