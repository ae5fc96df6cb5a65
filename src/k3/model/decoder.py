"""Decoder layer, K3Model and K3ForCausalLM, with Block Attention Residuals (SPEC §3.3).

Residual stream bookkeeping with AttnRes block size B (in decoder layers)::

    partial = embed(tokens); blocks = []
    for layer l:
        if l % B == 0: blocks.append(partial); partial = 0
        h = mix_attn(blocks + ([partial] if l % B else []));   partial += attn(norm(h))
        h = mix_mlp(blocks + [partial]);                       partial += mlp(norm(h))
    h = mix_out(blocks + [partial]); logits = lm_head(norm(h))

``mix`` is :func:`k3.ops.attn_res.attn_res_mix` with the layer's pseudo-query/key-norm pair. With
``attn_res_block_size=None`` the model uses standard pre-norm residuals.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from k3.config import K3Config
from k3.errors import K3Error
from k3.model.cache import K3Cache
from k3.model.kda import KimiDeltaAttention
from k3.model.mla import GatedMLA
from k3.model.mlp import GatedMLP
from k3.model.moe import LatentMoE
from k3.model.norm import RMSNorm
from k3.model.stats import ForwardStats
from k3.ops.attn_res import attn_res_mix, compiled_attn_res_mix
from k3.ops.loss import cross_entropy
from k3.ops.segments import Segments, document_starts

__all__ = ["DecoderLayer", "K3Model", "K3ForCausalLM", "CausalLMOutput", "AttnResPair"]


class AttnResPair(nn.Module):
    """One AttnRes pseudo-query (stored as a Linear(H, 1) weight, zero-init) and its key norm.

    Registered on the owner under ``{prefix}_proj`` / ``{prefix}_norm`` so checkpoint names match
    the release (``self_attention_res_proj.weight`` ...); this class only holds the mixing call.
    """

    @staticmethod
    def build(owner: nn.Module, prefix: str, hidden: int, eps: float) -> None:
        owner.add_module(f"{prefix}_proj", nn.Linear(hidden, 1, bias=False))
        owner.add_module(f"{prefix}_norm", RMSNorm(hidden, eps))
        AttnResPair.reset(owner, prefix)

    @staticmethod
    @torch.no_grad()
    def reset(owner: nn.Module, prefix: str) -> None:
        """Pseudo-query 0 (a uniform mix at step 0); the key norm is an RMSNorm (weight 1)."""
        if hasattr(owner, f"{prefix}_proj"):
            nn.init.zeros_(getattr(owner, f"{prefix}_proj").weight)

    @staticmethod
    def mix(owner: nn.Module, prefix: str, sources: list[torch.Tensor], prepared=None) -> torch.Tensor:
        """Mix ``sources`` with the owner's pair; eager unless the owner's ``attn_res_compiled`` is
        set (``K3ForCausalLM.compile_attn_res``, an opt-in: compiled rounding differs from eager).
        ``prepared``: the owner's prepared decode backend, which mixes with the pair folded."""
        if prepared is not None:
            return prepared.mix(prefix, sources)
        proj, norm = getattr(owner, f"{prefix}_proj"), getattr(owner, f"{prefix}_norm")
        compiled = getattr(owner, "attn_res_compiled", False) and len(sources) > 1
        fn = compiled_attn_res_mix if compiled else attn_res_mix
        return fn(sources, proj.weight, norm.weight, norm.eps)


class DecoderLayer(nn.Module):
    def __init__(self, config: K3Config, layer_idx: int):
        super().__init__()
        H, eps = config.hidden_size, config.rms_norm_eps
        self.layer_idx = layer_idx
        self.is_kda = config.is_kda_layer(layer_idx)
        self.self_attn = KimiDeltaAttention(config, layer_idx) if self.is_kda else GatedMLA(config, layer_idx)
        self.input_layernorm = RMSNorm(H, eps)
        self.post_attention_layernorm = RMSNorm(H, eps)
        if config.is_moe_layer(layer_idx):
            self.block_sparse_moe = LatentMoE(config)
        else:
            self.mlp = GatedMLP(H, config.intermediate_size, config)
        self.attn_res = config.attn_res_block_size is not None
        if self.attn_res:
            AttnResPair.build(self, "self_attention_res", H, eps)
            AttnResPair.build(self, "mlp_res", H, eps)

    def reset_parameters(self) -> None:
        """The layer's own tensors: the AttnRes pseudo-queries (sublayers reset themselves)."""
        AttnResPair.reset(self, "self_attention_res")
        AttnResPair.reset(self, "mlp_res")

    @property
    def ffn(self) -> nn.Module:
        return self.block_sparse_moe if hasattr(self, "block_sparse_moe") else self.mlp

    def _mix_tokens(self, x: torch.Tensor, state, segs: Segments | None,
                    stats: ForwardStats | None) -> torch.Tensor:
        """The token mixer (KDA or MLA) on x [B,T,H]; with ``segs`` each packed document alone.
        ``stats`` goes to MLA (its max logits); KDA measures nothing."""
        kw = {} if stats is None or self.is_kda else {"stats": stats}
        if segs is None:
            return self.self_attn(x, state, **kw)
        return segs.from_docs([self.self_attn(part, state, **kw) for part in segs.to_docs(x)])

    # Each sublayer runs either over its modules or, given a ``prepared`` layer (the decode backend
    # of k3.infer.prepared: the same math over weights prepared once), through that backend, which
    # takes the stream as [B, H] rows.
    def _attn(self, h: torch.Tensor, res: torch.Tensor | None, state, segs: Segments | None,
              prepared, stats: ForwardStats | None) -> torch.Tensor:
        """res + token mixer(input_layernorm(h)); res None: the mixer's output alone."""
        if prepared is not None:
            return prepared.attn(h, res, state)
        a = self._mix_tokens(self.input_layernorm(h), state, segs, stats)
        return a if res is None else res + a

    def _ffn(self, h: torch.Tensor, res: torch.Tensor, prepared, stats: ForwardStats | None) -> torch.Tensor:
        """res + ffn(post_attention_layernorm(h)); ``stats`` goes to a MoE (its router statistics)."""
        if prepared is not None:
            return prepared.ffn(h, res)
        h = self.post_attention_layernorm(h)
        if stats is not None and hasattr(self, "block_sparse_moe"):
            return res + self.block_sparse_moe(h, stats=stats)
        return res + self.ffn(h)

    def forward(self, h: torch.Tensor, state=None, segs: Segments | None = None, prepared=None,
                stats: ForwardStats | None = None) -> torch.Tensor:
        """Standard pre-norm residual layer: h [B,T,H] -> [B,T,H]."""
        h = self._attn(h, h, state, segs, prepared, stats)
        return self._ffn(h, h, prepared, stats)

    def forward_attn_res(self, blocks: list[torch.Tensor], partial: torch.Tensor | None,
                         state=None, segs: Segments | None = None, prepared=None,
                         stats: ForwardStats | None = None) -> torch.Tensor:
        """One AttnRes layer: returns the new partial sum (see module docstring)."""
        srcs = blocks if partial is None else blocks + [partial]
        h = AttnResPair.mix(self, "self_attention_res", srcs, prepared)
        partial = self._attn(h, partial, state, segs, prepared, stats)
        h = AttnResPair.mix(self, "mlp_res", blocks + [partial], prepared)
        return self._ffn(h, partial, prepared, stats)


class K3Model(nn.Module):
    def __init__(self, config: K3Config):
        super().__init__()
        if config.num_nextn_predict_layers:
            raise ValueError("num_nextn_predict_layers > 0 (multi-token prediction) is not supported yet")
        self.config = config
        H = config.hidden_size
        self.embed_tokens = nn.Embedding(config.vocab_size, H)
        self._reset_embedding()
        self.layers = nn.ModuleList(DecoderLayer(config, l) for l in range(config.num_hidden_layers))
        self.norm = RMSNorm(H, config.rms_norm_eps)
        if config.attn_res_block_size is not None:
            AttnResPair.build(self, "output_attn_res", H, config.rms_norm_eps)

    @torch.no_grad()
    def _reset_embedding(self) -> None:
        nn.init.normal_(self.embed_tokens.weight, std=self.config.initializer_range)

    def reset_parameters(self) -> None:
        """Embedding ~ N(0, initializer_range), output AttnRes pseudo-query 0 (norms reset themselves)."""
        self._reset_embedding()
        AttnResPair.reset(self, "output_attn_res")

    def check_ids(self, input_ids: torch.Tensor) -> None:
        """input_ids must be [B,T] integers inside the vocabulary (on the CPU a ValueError naming the
        range; on an accelerator a device-side assertion, so a step never waits for the device)."""
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, seq], got shape {tuple(input_ids.shape)}")
        if input_ids.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"input_ids must be an integer tensor, got {input_ids.dtype}")
        if not input_ids.numel() or input_ids.device.type == "meta":
            return
        V = self.config.vocab_size
        if input_ids.device.type == "cpu":
            lo, hi = int(input_ids.min()), int(input_ids.max())
            if lo < 0 or hi >= V:
                raise ValueError(f"input_ids outside the vocabulary [0, {V}): min {lo}, max {hi}")
        else:  # an accelerator: checked on the device, without waiting for it (no host sync)
            inside = ((input_ids >= 0) & (input_ids < V)).all()
            torch._assert_async(inside, f"input_ids outside the vocabulary [0, {V})")

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [B,T] (checked) -> token embeddings [B,T,H], exactly what ``forward`` starts from."""
        self.check_ids(input_ids)
        return self.embed_tokens(input_ids)

    def forward(self, input_ids: torch.Tensor | None = None, cache: K3Cache | None = None,
                doc_ids: torch.Tensor | None = None, inputs_embeds: torch.Tensor | None = None,
                prepared=None, stats: ForwardStats | None = None) -> torch.Tensor:
        """input_ids [B,T] int64 -> final normed hidden states [B,T,H].

        With a cache, row b's T tokens continue its sequence at positions ``cache.seq_lens[b]`` ..
        ``+T−1`` (rows may differ in length; K3 is NoPE, so only the MLA mask depends on it).
        ``doc_ids`` [B,T] marks packed documents (a run of equal ids in a row is one document):
        every token mixer starts each document from zero state and attends within it only
        (:mod:`k3.ops.segments`), so a packed row equals its documents run alone.
        ``inputs_embeds`` [B,T,H] replaces ``input_ids`` (exactly one of the two): precomputed
        embeddings (e.g. image rows at ``<|media_pad|>`` positions) enter the same stack, so
        ``inputs_embeds=embed(ids)`` gives bit-for-bit what ``input_ids=ids`` gives.
        ``prepared`` (``k3.infer.prepared.PreparedModel``, a decode step only: one token per row of a
        prefilled cache, no gradient) runs each sublayer through its prepared-weights backend: the
        same layers and cache updates, the math within float rounding of the modules'.
        ``stats`` (:class:`k3.model.stats.ForwardStats`): the layers add what they measure (router
        statistics, MLA max logits) to it; None measures nothing.
        """
        cfg = self.config
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids and inputs_embeds")
        if inputs_embeds is None:
            self.check_ids(input_ids)
            B, T = input_ids.shape
        else:
            if inputs_embeds.dim() != 3 or inputs_embeds.shape[-1] != cfg.hidden_size:
                raise ValueError(f"inputs_embeds must be [batch, seq, {cfg.hidden_size}], got shape "
                                 f"{tuple(inputs_embeds.shape)}")
            if not inputs_embeds.is_floating_point():
                raise TypeError(f"inputs_embeds must be a floating-point tensor, got {inputs_embeds.dtype}")
            B, T = inputs_embeds.shape[:2]
        if cache is not None:
            if not isinstance(cache, K3Cache):
                raise TypeError(f"cache must be a K3Cache, got {type(cache).__name__}")
            cache.check(cfg, B)
        seen = cache.max_seq_len if cache is not None else 0
        if seen + T > cfg.max_position_embeddings:
            raise ValueError(f"sequence length {T} (+{seen} cached) exceeds "
                             f"max_position_embeddings={cfg.max_position_embeddings}")
        if prepared is not None and (cache is None or T != 1 or torch.is_grad_enabled()):
            raise ValueError("prepared weights serve a decode step only: one token per row, a cache, "
                             f"no gradient (got T={T}, cache={'yes' if cache is not None else 'no'}, "
                             f"grad={'on' if torch.is_grad_enabled() else 'off'})")
        if prepared is not None and stats is not None:
            raise ValueError("prepared weights measure no statistics: pass stats=None with prepared "
                             "(router statistics and max logits come from the modules' forward)")
        if stats is not None and not isinstance(stats, ForwardStats):
            raise TypeError(f"stats must be a k3.model.stats.ForwardStats, got {type(stats).__name__}")
        segs = None
        if doc_ids is not None:
            if cache is not None:
                raise ValueError("doc_ids (packed documents) cannot be combined with a cache: "
                                 "packing is for training; run each sequence in its own cache row")
            if tuple(doc_ids.shape) != (B, T):
                raise ValueError(f"doc_ids shape {tuple(doc_ids.shape)} != input_ids shape {(B, T)}")
            segs = Segments.of(doc_ids.to((input_ids if inputs_embeds is None else inputs_embeds).device))
        states = cache.layers if cache is not None else [None] * len(self.layers)
        x = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        preps = prepared.layers if prepared is not None else [None] * len(self.layers)
        if prepared is not None:
            x = x[:, 0]             # the prepared backend works on [B, H] rows (one token each)
        if cfg.attn_res_block_size is None:
            for layer, st, p in zip(self.layers, states, preps):
                x = layer(x, st, segs, p, stats=stats)
        else:
            bs = cfg.attn_res_block_size
            blocks: list[torch.Tensor] = []
            partial: torch.Tensor | None = x
            for l, (layer, st, p) in enumerate(zip(self.layers, states, preps)):
                if l % bs == 0:
                    blocks.append(partial)
                    partial = None
                partial = layer.forward_attn_res(blocks, partial, st, segs, p, stats=stats)
            x = AttnResPair.mix(self, "output_attn_res", blocks + [partial], prepared)
        if cache is not None:
            cache.seq_lens = cache.seq_lens + T
        return self.norm(x) if prepared is None else prepared.norm(x)[:, None]


@dataclass
class CausalLMOutput:
    logits: torch.Tensor
    loss: torch.Tensor | None = None
    cache: K3Cache | None = None
    stats: ForwardStats | None = None    # what the forward measured, when it was given one


class K3ForCausalLM(nn.Module):
    """K3 text model with an LM head. ``model(input_ids, labels=None, cache=None)``.

    ``labels`` follow the HF convention: aligned with ``input_ids`` and shifted inside, so the loss
    is the mean next-token cross-entropy over positions whose label is not -100.
    """

    def __init__(self, config: K3Config):
        super().__init__()
        if not isinstance(config, K3Config):
            raise TypeError(f"config must be a K3Config, got {type(config).__name__}")
        self.config = config
        self.model = K3Model(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.reset_parameters()
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def compile_attn_res(self, on: bool = True) -> "K3ForCausalLM":
        """Opt in (or out) to ``torch.compile``'d AttnRes mixing in this model only (the same math,
        fused; fp32 rounding differs from eager, so golden-compared runs stay eager). Returns self."""
        if self.config.attn_res_block_size is None:
            raise ValueError("compile_attn_res: this model has no Block AttnRes (attn_res_block_size is None)")
        for m in self.modules():
            if isinstance(m, (DecoderLayer, K3Model)):
                m.attn_res_compiled = bool(on)
        return self

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """lm_head ~ N(0, initializer_range) (tied: the shared embedding, drawn again)."""
        nn.init.normal_(self.lm_head.weight, std=self.config.initializer_range)

    @torch.no_grad()
    def init_weights(self) -> "K3ForCausalLM":
        """(Re-)initialise every parameter and buffer as eager construction does; returns self.

        For a model built on the meta device and materialised with ``to_empty``: every k3 module
        owns the init of its direct tensors (``reset_parameters``: N(0, initializer_range) for
        projections, embeddings and experts, 1 for norms, 0 for pseudo-queries and router biases,
        KDA's A_log / dt_bias / conv as in Kimi Linear); torch's own layers (``nn.Linear`` ...) are
        initialised by their k3 owner, never by their torch defaults. Modules are visited parent
        first. A k3 module that holds tensors of its own without a ``reset_parameters`` is an error.
        With ``tie_word_embeddings`` the tie is restored first (``to_empty`` gives the embedding
        and the lm_head separate tensors).
        """
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        for name, m in self.named_modules():
            if not type(m).__module__.startswith("k3."):
                continue
            reset = getattr(m, "reset_parameters", None)
            if reset is None:
                own = [n for n, _ in [*m.named_parameters(recurse=False), *m.named_buffers(recurse=False)]]
                if own:
                    raise K3Error(f"init_weights: {name or 'model'} ({type(m).__name__}) has tensors "
                                    f"{own} but no reset_parameters()")
                continue
            reset()
        return self

    def new_cache(self, batch_size: int) -> K3Cache:
        """An empty inference cache for ``batch_size`` sequences."""
        return K3Cache(self.config, batch_size)

    def forward(self, input_ids: torch.Tensor | None = None, labels: torch.Tensor | None = None,
                cache: K3Cache | None = None, logits_to_keep: int = 0,
                doc_ids: torch.Tensor | None = None, inputs_embeds: torch.Tensor | None = None,
                prepared=None, stats: ForwardStats | None = None) -> CausalLMOutput:
        """``logits_to_keep`` > 0 computes logits for the last that many positions only (decode).
        ``doc_ids``: packed documents (``K3Model.forward``); the loss then never predicts the first
        token of a document from the end of the one before it. ``inputs_embeds`` [B,T,H] in place
        of ``input_ids`` (``K3Model.forward``). ``prepared``: a decode step through prepared
        weights (``K3Model.forward``; the lm_head too). ``stats``: a ForwardStats the layers fill
        (router statistics, MLA max logits; ``K3Model.forward``), returned as ``output.stats``."""
        h = self.model(input_ids, cache, doc_ids, inputs_embeds=inputs_embeds, prepared=prepared, stats=stats)
        tokens_shape = h.shape[:2]  # [B, T] of input_ids (or inputs_embeds)
        if logits_to_keep:
            h = h[:, -logits_to_keep:]
        logits = self.lm_head(h) if prepared is None else prepared.lm_head(h)
        loss = None
        if labels is not None:
            if labels.shape != tokens_shape:
                raise ValueError(f"labels shape {tuple(labels.shape)} != input_ids shape "
                                 f"{tuple(tokens_shape)}")
            if logits_to_keep:
                raise ValueError("labels cannot be combined with logits_to_keep")
            # position t predicts labels[t + 1]; the last position has no target (ignored), so the
            # logits go to the loss whole, not as a shifted copy whose backward zero-fills [B, T, V]
            target = torch.cat([labels[:, 1:], labels.new_full((labels.shape[0], 1), -100)], 1)
            if doc_ids is not None:  # the last token of a document has no next token to predict
                ends = torch.cat([document_starts(doc_ids)[:, 1:], torch.ones_like(doc_ids[:, :1], dtype=torch.bool)], 1)
                target = target.masked_fill(ends.to(target.device), -100)
            loss = cross_entropy(logits.flatten(0, 1), target.flatten(), -100)
        return CausalLMOutput(logits=logits, loss=loss, cache=cache, stats=stats)

    def moe_layers(self) -> list[LatentMoE]:
        return [layer.block_sparse_moe for layer in self.model.layers if hasattr(layer, "block_sparse_moe")]
