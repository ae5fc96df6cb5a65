"""Images of one engine request (issue 34): pixels, their tower rows, and the prefix-cache key.

A prompt holds each image as its media block (``k3.data.chat``); ``PromptImages.of(prompt,
sources, vision_model)`` preprocesses the images (``k3.data.images``) and checks that the prompt
holds exactly as many ``<|media_pad|>`` tokens as the images give rows. The tower runs once, at the
request's first prefill chunk (``rows``); each chunk then embeds its tokens and puts the rows of
the pads it holds in their place (``embed``) — the same placement as
``K3VLForConditionalGeneration.embed`` over the whole prompt, chunk by chunk.

The prefix cache keys token ids; two images of one size render to the same ids, so the key of a
prompt with images (``key``) replaces the j-th pad of an image by ``-(1 + (h << 20) + j)``, h the
first 40 bits of the sha256 of the image's pixel values: the same image hits, another misses.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import torch

from k3.data.images import preprocess
from k3.errors import K3Error

__all__ = ["PromptImages"]


@dataclass
class PromptImages:
    pixel_values: torch.Tensor     # [N, 3, p, p] packed patches
    grid_thws: torch.Tensor        # [n, 3]
    counts: list[int]              # rows (pads) per image
    digests: list[int]             # 40-bit content hash per image
    pad_id: int
    _rows: torch.Tensor | None = field(default=None, repr=False)

    @classmethod
    def of(cls, prompt: list[int], sources, vision_model) -> "PromptImages":
        """Preprocess ``sources`` for ``vision_model`` (a K3VLForConditionalGeneration) and check
        them against the prompt's pads (K3Error naming both counts)."""
        if not isinstance(sources, (list, tuple)) or not sources:
            raise K3Error("images: a non-empty list of images (paths, bytes, data: URLs or PIL images)")
        pv, grids, _ = preprocess(sources, vision_model.image_proc)
        kh, kw = vision_model.vision_config.merge_kernel_size
        counts = [int(t * (h // kh) * (w // kw)) for t, h, w in grids.tolist()]
        pad = vision_model.media_pad_token_id
        n_pad = sum(1 for t in prompt if t == pad)
        if n_pad != sum(counts):
            raise K3Error(f"prompt: holds {n_pad} <|media_pad|> token(s) (id {pad}) but the {len(counts)} "
                          f"image(s) give {sum(counts)} row(s) ({counts}); render the chat with its images")
        digests, first = [], 0
        for t, h, w in grids.tolist():
            n = t * h * w
            digests.append(int.from_bytes(hashlib.sha256(pv[first:first + n].numpy().tobytes()).digest()[:5], "big"))
            first += n
        return cls(pv, grids, counts, digests, pad)

    def key(self, prompt: list[int]) -> list[int]:
        """The prompt with each image's pads replaced by content-derived negative ids."""
        out, image, j = [], 0, 0
        for t in prompt:
            if t != self.pad_id:
                out.append(t)
                continue
            out.append(-(1 + (self.digests[image] << 20) + j))
            j += 1
            if j == self.counts[image]:
                image, j = image + 1, 0
        return out

    def rows(self, vision_model, dtype: torch.dtype, device) -> torch.Tensor:
        """The projected rows [M, H] of every image (the tower runs once per request)."""
        if self._rows is None:
            self._rows = vision_model.image_features(self.pixel_values.to(device), self.grid_thws).to(dtype)
        return self._rows

    def embed(self, lm, prompt: list[int], ids: torch.Tensor, pos: int, rows: torch.Tensor) -> torch.Tensor:
        """Embeddings [1, n, H] of the chunk ``ids`` = prompt[pos:pos+n], image rows at its pads."""
        x = lm.model.embed(ids)
        is_pad = ids[0] == self.pad_id
        if bool(is_pad.any()):
            before = sum(1 for t in prompt[:pos] if t == self.pad_id)
            x = x.clone()
            x[0, is_pad] = rows[before:before + int(is_pad.sum())]
        return x
