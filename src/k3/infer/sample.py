"""Autoregressive generation through the model's inference cache.

``generate`` runs the prompt once (prefill: chunked KDA, naive MLA, filling a ``K3Cache``), then
feeds one token at a time through the cache (recurrent KDA, absorbed MLA), so each new token costs
one position rather than a forward over the whole sequence.

Sampling of the next token from logits [B, V] (``sample_next_token``):
temperature 0 → argmax; otherwise ``softmax(logits / temperature)`` restricted to the ``top_k``
largest logits and to the smallest set of tokens whose probability sums to ≥ ``top_p`` (nucleus),
renormalised, drawn with a ``torch.Generator`` seeded by ``seed``.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["generate", "sample_next_token"]


def sample_next_token(logits: torch.Tensor, temperature: float = 0.0, top_k: int | None = None,
                      top_p: float | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
    """logits [B, V] -> next token ids [B] int64."""
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be >= 1, got {top_k}")
    if top_p is not None and not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    logits = logits.float()
    if temperature == 0:
        return logits.argmax(-1)
    logits = logits / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1:
        sorted_logits, order = logits.sort(-1, descending=True)
        probs = sorted_logits.softmax(-1)
        # drop a token when the tokens ranked above it already reach top_p (the first always stays)
        drop = probs.cumsum(-1) - probs >= top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    probs = logits.softmax(-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@torch.no_grad()
def generate(model: nn.Module, input_ids: torch.Tensor, max_new_tokens: int, temperature: float = 0.0,
             top_k: int | None = None, top_p: float | None = None, seed: int | None = None,
             eos: int | None = None, on_token=None) -> torch.Tensor:
    """Continue ``input_ids`` ([T] or [B, T]) by up to ``max_new_tokens`` tokens.

    Returns the prompt plus the new tokens, same rank as the input. With ``eos``, a sequence that
    produced it is padded with ``eos`` from then on and generation stops once all have.
    ``on_token(ids [B])`` is called with each new token (streaming). The model's train/eval mode
    is restored afterwards.
    """
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    squeeze = input_ids.dim() == 1
    ids = input_ids.unsqueeze(0) if squeeze else input_ids
    if ids.dim() != 2 or ids.shape[1] == 0:
        raise ValueError(f"input_ids must be a non-empty [T] or [B, T] tensor, got shape {tuple(input_ids.shape)}")
    max_pos = model.config.max_position_embeddings
    if ids.shape[1] + max_new_tokens > max_pos:
        raise ValueError(f"prompt ({ids.shape[1]} tokens) + max_new_tokens ({max_new_tokens}) exceeds "
                         f"max_position_embeddings={max_pos}")
    device = next(model.parameters()).device
    ids = ids.to(device)
    gen = None
    if seed is not None:
        gen = torch.Generator(device=device).manual_seed(seed)
    was_training = model.training
    model.eval()
    try:
        cache = model.new_cache(ids.shape[0])
        logits = model(ids, cache=cache, logits_to_keep=1).logits[:, -1]
        out = [ids]
        done = torch.zeros(ids.shape[0], dtype=torch.bool, device=device)
        for i in range(max_new_tokens):
            nxt = sample_next_token(logits, temperature, top_k, top_p, gen)
            if eos is not None:
                nxt = nxt.masked_fill(done, eos)
                done |= nxt == eos
            out.append(nxt[:, None])
            if on_token is not None:
                on_token(nxt)
            if (eos is not None and bool(done.all())) or i == max_new_tokens - 1:
                break
            logits = model(nxt[:, None], cache=cache, logits_to_keep=1).logits[:, -1]
    finally:
        model.train(was_training)
    res = torch.cat(out, dim=1)
    return res[0] if squeeze else res
