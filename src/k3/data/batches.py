"""Training batches whose rows come from B cursors spread over the token stream (SPEC §5)."""

from __future__ import annotations

from typing import Any

import torch

from k3.data.packing import PackedBatches

__all__ = ["StridedBatches"]


class StridedBatches:
    """Batches whose B rows come from B cursors spread evenly over the token stream.

    ``PackedBatches`` cuts a batch from one contiguous B·T span, which on a code corpus is mostly a
    single file; rows from B distant places make each step's gradient an average over B documents
    (with contiguous batches the tiny demo's loss jumped by several nats between steps, as the
    batch moved from a data table to ordinary code). Row r starts at r·len/B and walks
    like its own ``PackedBatches`` (wrapping independently); the state is the B cursors.
    """

    def __init__(self, tokens, batch_size: int, seq_len: int):
        self.rows = [PackedBatches(tokens, 1, seq_len) for _ in range(batch_size)]
        for r, row in enumerate(self.rows):
            row.pos = r * (len(tokens) // batch_size)

    def next_batch(self, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        xs, ys = zip(*(row.next_batch(seq_len) for row in self.rows))
        return torch.cat(xs), torch.cat(ys)

    def state_dict(self) -> dict[str, Any]:
        return {"rows": [row.state_dict() for row in self.rows]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if len(state["rows"]) != len(self.rows):
            raise ValueError(f"data state has {len(state['rows'])} rows but batch_size is {len(self.rows)}")
        for row, st in zip(self.rows, state["rows"]):
            row.load_state_dict(st)
