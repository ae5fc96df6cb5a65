"""Documents packed into rows (SPEC §10): the gather that lets a token mixer see each document alone.

A packed batch ``x [B, T, ...]`` holds several documents per row; ``doc_ids [B, T]`` names them: a
document is a maximal run of equal ids within a row (so ``[0,0,0,1,1,2]`` is three documents, and
rows never share one). Token mixers (KDA's recurrence and short convolution, MLA's causal
attention) must not carry anything from one document into the next. ``Segments`` re-lays the rows
as one row per document (``to_docs``) and back (``from_docs``: [B, T, ...]). Documents of similar
length share a group, a tensor [N_g, L_g, ...] right-padded to its longest (``groups``: the
partition of the length-sorted documents into at most ``MAX_GROUPS`` runs that minimizes the
padded size plus ``GROUP_COST`` per group), so a batch mixing short and long documents is not
padded to its longest everywhere. Padded slots repeat their document's last token; they come
after every real token of their row, so causal mixers never let them reach a real position (and a
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


MAX_GROUPS = 4       # token-mixer calls per layer at most
GROUP_COST = 256     # padded token slots one more group must save to be worth its call


def length_groups(lengths: list[int], max_groups: int = MAX_GROUPS, cost: int = GROUP_COST) -> list[int]:
    """Cut points of ``sorted(lengths)`` into at most ``max_groups`` runs minimizing
    Σ (docs in run × longest in run) + cost × runs (exact, by dynamic programming): the ends
    (exclusive) of the runs, the last being ``len(lengths)``."""
    ls = sorted(lengths)
    n = len(ls)
    INF = float("inf")
    best = [[INF] * (n + 1) for _ in range(max_groups + 1)]   # best[g][i]: first i docs in g runs
    cut = [[0] * (n + 1) for _ in range(max_groups + 1)]
    best[0][0] = 0
    for g in range(1, max_groups + 1):
        for i in range(1, n + 1):
            for j in range(g - 1, i):                           # the run is docs j .. i-1
                c = best[g - 1][j] + (i - j) * ls[i - 1] + cost
                if c < best[g][i]:
                    best[g][i], cut[g][i] = c, j
    g = min(range(1, max_groups + 1), key=lambda k: best[k][n])
    ends, i = [], n
    while g > 0:
        ends.append(i)
        i, g = cut[g][i], g - 1
    return ends[::-1]


@dataclass(frozen=True)
class Segments:
    """The re-layout of one packed batch: per group, ``index`` [N_g·L_g] (flat packed position of
    each document slot, padded slots clamped to the document's last token) and its shape; and
    ``inverse`` [B·T] (the flat slot of each packed position in the groups laid end to end)."""

    batch: int
    seq_len: int
    groups: tuple[tuple[int, int], ...]     # (N_g, L_g)
    index: tuple[torch.Tensor, ...]
    inverse: torch.Tensor
    lengths: torch.Tensor                   # [N] in packed order

    @property
    def num_docs(self) -> int:
        return sum(n for n, _ in self.groups)

    @property
    def padded_tokens(self) -> int:
        return sum(n * L for n, L in self.groups)

    @staticmethod
    def of(doc_ids: torch.Tensor, max_groups: int = MAX_GROUPS) -> "Segments | None":
        if doc_ids.dim() != 2:
            raise ValueError(f"doc_ids must be [batch, seq], got shape {tuple(doc_ids.shape)}")
        if doc_ids.dtype.is_floating_point or doc_ids.dtype == torch.bool:
            raise TypeError(f"doc_ids must be an integer tensor, got {doc_ids.dtype}")
        B, T = doc_ids.shape
        dev = doc_ids.device
        start = document_starts(doc_ids).flatten()
        first = start.nonzero().flatten()                                   # [N] flat start positions
        N = first.numel()
        if N == B:                                                          # one document per row
            return None
        lengths = torch.diff(first, append=first.new_tensor([B * T]))        # rows end at multiples of T
        lens = lengths.tolist()
        order = sorted(range(N), key=lambda k: lens[k])                     # stable: ties keep packed order
        ends = length_groups(lens, max_groups)
        doc = torch.cumsum(start.long(), 0) - 1                              # [B·T] document of each position
        offset = torch.arange(B * T, device=dev) - first[doc]
        slot_of_doc = torch.empty(N, dtype=torch.long)                      # flat slot of each doc's token 0
        groups, index, base, s = [], [], 0, 0
        for e in ends:
            members = order[s:e]
            L = max(lens[k] for k in members)
            m = torch.tensor(members, dtype=torch.long)
            slot_of_doc[m] = base + torch.arange(len(members)) * L
            j = torch.arange(L, device=dev)
            f, n = first[m.to(dev)], lengths[m.to(dev)]
            index.append((f[:, None] + torch.minimum(j[None, :], n[:, None] - 1)).flatten())
            groups.append((len(members), L))
            base += len(members) * L
            s = e
        inverse = slot_of_doc.to(dev)[doc] + offset
        return Segments(B, T, tuple(groups), tuple(index), inverse, lengths)

    def to_docs(self, x: torch.Tensor) -> list[torch.Tensor]:
        """x [B, T, ...] -> one [N_g, L_g, ...] per group (a document per row, right-padded)."""
        if tuple(x.shape[:2]) != (self.batch, self.seq_len):
            raise ValueError(f"Segments.to_docs: expected [{self.batch}, {self.seq_len}, ...], "
                             f"got {tuple(x.shape)}")
        flat = x.reshape(self.batch * self.seq_len, *x.shape[2:])
        return [flat.index_select(0, idx).view(n, L, *x.shape[2:])
                for idx, (n, L) in zip(self.index, self.groups)]

    def from_docs(self, ys: list[torch.Tensor]) -> torch.Tensor:
        """The groups' outputs [N_g, L_g, ...] -> [B, T, ...] (the packed layout; padding dropped)."""
        rest = ys[0].shape[2:]
        flat = torch.cat([y.reshape(-1, *rest) for y in ys]) if len(ys) > 1 else ys[0].reshape(-1, *rest)
        return flat.index_select(0, self.inverse).view(self.batch, self.seq_len, *rest)
