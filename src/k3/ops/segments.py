"""Documents packed into rows (SPEC §10): the gather that lets a token mixer see each document alone.

A packed batch ``x [B, T, ...]`` holds several documents per row; ``doc_ids [B, T]`` names them: a
document is a maximal run of equal ids within a row (so ``[0,0,0,1,1,2]`` is three documents, and
rows never share one). Token mixers (KDA's recurrence and short convolution, MLA's causal
attention) must not carry anything from one document into the next. ``Segments`` re-lays the rows
as one row per document, right-padded to the longest (``to_docs``: [N, L, ...]), and back
(``from_docs``: [B, T, ...]). Padded slots repeat their document's last token; they come after
every real token of their row, so causal mixers never let them reach a real position (and a
maximum over scores sees only scores of real token pairs). Both directions are gathers, so
gradients flow through them. Per-token layers (norms, MLPs, MoE, AttnRes) need no re-layout.

``Segments.of(doc_ids)`` returns None when every row is a single document: nothing to re-lay.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["Segments", "document_starts"]


def document_starts(doc_ids: torch.Tensor) -> torch.Tensor:
    """[B, T] bool: True at the first token of each document (t = 0, or an id change)."""
    start = torch.ones_like(doc_ids, dtype=torch.bool)
    start[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    return start


@dataclass(frozen=True)
class Segments:
    """The re-layout of one packed batch: ``index`` [N·L] (flat packed position of each document
    slot, padded slots clamped to the document's last token) and ``inverse`` [B·T] (flat document
    slot of each packed position)."""

    batch: int
    seq_len: int
    num_docs: int
    max_len: int
    index: torch.Tensor
    inverse: torch.Tensor
    lengths: torch.Tensor

    @staticmethod
    def of(doc_ids: torch.Tensor) -> "Segments | None":
        if doc_ids.dim() != 2:
            raise ValueError(f"doc_ids must be [batch, seq], got shape {tuple(doc_ids.shape)}")
        if doc_ids.dtype.is_floating_point or doc_ids.dtype == torch.bool:
            raise TypeError(f"doc_ids must be an integer tensor, got {doc_ids.dtype}")
        B, T = doc_ids.shape
        start = document_starts(doc_ids).flatten()
        first = start.nonzero().flatten()                                   # [N] flat start positions
        N = first.numel()
        if N == B:                                                          # one document per row
            return None
        lengths = torch.diff(first, append=first.new_tensor([B * T]))        # rows end at multiples of T
        L = int(lengths.max())
        doc = torch.cumsum(start.long(), 0) - 1                              # [B·T] document of each position
        offset = torch.arange(B * T, device=doc_ids.device) - first[doc]
        inverse = doc * L + offset
        j = torch.arange(L, device=doc_ids.device)
        index = first[:, None] + torch.minimum(j[None, :], lengths[:, None] - 1)
        return Segments(B, T, N, L, index.flatten(), inverse, lengths)

    def to_docs(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, T, ...] -> [N, L, ...] (one document per row, right-padded)."""
        if tuple(x.shape[:2]) != (self.batch, self.seq_len):
            raise ValueError(f"Segments.to_docs: expected [{self.batch}, {self.seq_len}, ...], "
                             f"got {tuple(x.shape)}")
        flat = x.reshape(self.batch * self.seq_len, *x.shape[2:])
        return flat.index_select(0, self.index).view(self.num_docs, self.max_len, *x.shape[2:])

    def from_docs(self, y: torch.Tensor) -> torch.Tensor:
        """y [N, L, ...] -> [B, T, ...] (the packed layout back; padded slots dropped)."""
        flat = y.reshape(self.num_docs * self.max_len, *y.shape[2:])
        return flat.index_select(0, self.inverse).view(self.batch, self.seq_len, *y.shape[2:])
