"""``k3.generate(model, input_ids, max_new_tokens, ...)``: the familiar one-call entry point.

A thin wrapper over ``Engine``: every row of ``input_ids`` is one request (row ``i`` seeded with
``seed + i``), the engine's cached prefill/decode produces the tokens, and the result is the
prompt plus the new tokens as one tensor. With ``eos`` a row ends when it samples ``eos`` and is
padded with ``eos`` up to the longest row; the config's EOS is not used unless passed as ``eos``.
"""

from __future__ import annotations

import torch
from torch import nn

from k3.errors import K3Error

__all__ = ["generate"]


@torch.no_grad()
def generate(model: nn.Module, input_ids: torch.Tensor, max_new_tokens: int = 16, temperature: float = 0.0,
             top_k: int | None = None, top_p: float | None = None, seed: int | None = None,
             eos: int | None = None, on_token=None, **sampling) -> torch.Tensor:
    """Continue ``input_ids`` ([T] or [B, T]) by up to ``max_new_tokens`` tokens.

    ``on_token(ids [B])`` is called once per step (rows already ended repeat ``eos``);
    further ``SamplingParams`` fields (``min_p``, penalties, ...) pass through ``sampling``.
    The model's train/eval mode is restored afterwards.
    """
    from k3.infer.engine import Engine
    from k3.infer.sampling import SamplingParams

    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise K3Error(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
    squeeze = input_ids.dim() == 1
    ids = input_ids.unsqueeze(0) if squeeze else input_ids
    if ids.dim() != 2 or ids.shape[1] == 0:
        raise K3Error(f"input_ids must be a non-empty [T] or [B, T] tensor, got shape {tuple(input_ids.shape)}")
    max_pos = model.config.max_position_embeddings
    if ids.shape[1] + max_new_tokens > max_pos:
        raise K3Error(f"prompt ({ids.shape[1]} tokens) + max_new_tokens ({max_new_tokens}) exceeds "
                      f"max_position_embeddings={max_pos}")
    base = dict(temperature=temperature, top_k=top_k, top_p=1.0 if top_p is None else top_p,
                stop_token_ids=() if eos is None else (eos,), ignore_eos=True, **sampling)
    SamplingParams(**base)  # a bad value fails here, before any work
    if max_new_tokens == 0:
        return input_ids.clone()
    was_training = model.training
    rows = ids.tolist()
    try:
        with Engine(model, max_batch=len(rows)) as engine:
            handles = [engine.submit(r, SamplingParams(max_tokens=max_new_tokens, **base,
                                                       seed=None if seed is None else seed + i))
                       for i, r in enumerate(rows)]
            outs = _collect(handles, eos, on_token, ids.device)
    finally:
        model.train(was_training)
    width = max(len(o) for o in outs)
    pad = 0 if eos is None else eos
    new = torch.tensor([o + [pad] * (width - len(o)) for o in outs], dtype=ids.dtype, device=ids.device)
    res = torch.cat([ids, new], dim=1)
    return res[0] if squeeze else res


def _collect(handles, eos, on_token, device) -> list[list[int]]:
    """Token ids of every handle, stepping them together so ``on_token`` sees one column a step."""
    iters = [iter(h) for h in handles]
    outs: list[list[int]] = [[] for _ in handles]
    live = [True] * len(handles)
    pad = 0 if eos is None else eos
    while any(live):
        col, fresh = [], False
        for i, it in enumerate(iters):
            ev = next(it, None) if live[i] else None  # a failed request raises here
            if ev is not None and ev.token_id is not None:
                outs[i].append(ev.token_id)
                fresh = True
            if ev is None or ev.finish_reason is not None:
                live[i] = False
            col.append(outs[i][-1] if ev is not None and ev.token_id is not None else pad)
        if fresh and on_token is not None:
            on_token(torch.tensor(col, device=device))
    for it in iters:
        next(it, None)  # drain: raises the error of a request that failed after its last token
    return outs
