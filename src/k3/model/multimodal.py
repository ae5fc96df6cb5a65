"""K3 with native vision (SPEC §3.9): ``K3VLForConditionalGeneration``.

    x       = language_model.model.embed(input_ids)                        [B, T, H]
    rows    = mm_projector(vision_tower(pixel_values, grid_thws))          [M, H]
    x[input_ids == media_pad_token_id] = rows        (in order: row-major across the batch)
    logits  = language_model(inputs_embeds=x)

Submodules carry the release's checkpoint names: ``language_model`` is a :class:`K3ForCausalLM`
(``language_model.model.…``, ``language_model.lm_head.weight``), ``vision_tower`` and
``mm_projector`` are the :class:`~k3.model.vision.VisionModel` halves (``vision_tower.encoder.…``,
``mm_projector.proj.0`` / ``.proj.2`` / ``.post_norm``).

Each image contributes (h/kh)(w/kw) rows; the prompt must hold exactly that many
``<|media_pad|>`` tokens per image, images in the order of ``pixel_values`` (preprocessing:
:mod:`k3.data.images`; ``ImageProcConfig.num_tokens`` gives each image's count). The pad id is the wrapper config's
``media_placeholder_token_id`` (163605 in the release, the default) unless the constructor is
given one (small tokenizers).

Files are :mod:`k3.checkpoint`'s business (this package never imports it):
``k3.checkpoint.save_pretrained(vl_model, dir)`` writes the release's multimodal layout and
``k3.checkpoint.from_pretrained(dir, model_class=K3VLForConditionalGeneration)`` reads it.
"""

from __future__ import annotations

import torch
from torch import nn

from k3.config import K3Config, check_int
from k3.errors import ConfigError, K3Error
from k3.model.decoder import CausalLMOutput, K3ForCausalLM
from k3.model.vision import VisionModel
from k3.config.vision import MEDIA_PAD_KEY, image_proc_for, vision_config_of

__all__ = ["K3VLForConditionalGeneration", "MEDIA_PAD_KEY", "RELEASE_MEDIA_PAD_TOKEN_ID", "media_pad_token_id_of",
           "images_of_rows"]

RELEASE_MEDIA_PAD_TOKEN_ID = 163605


def media_pad_token_id_of(config: K3Config) -> int:
    """The ``<|media_pad|>`` id a config declares (its kimi_k3 wrapper's
    ``media_placeholder_token_id``), else the release's 163605."""
    v = (config.wrapper or {}).get(MEDIA_PAD_KEY, RELEASE_MEDIA_PAD_TOKEN_ID)
    check_int(MEDIA_PAD_KEY, v, lo=0)
    return v


def images_of_rows(input_ids: torch.Tensor, pixel_values: torch.Tensor, grid_thws: torch.Tensor, rows: slice,
                   media_pad_token_id: int, merge_kernel_size) -> tuple[torch.Tensor, torch.Tensor]:
    """The images of ``input_ids[rows]``: their ``pixel_values`` rows and ``grid_thws`` rows.

    Images are packed in token order, row-major across the batch (``embed``); an item of grid
    (t, h, w) holds t·h·w patch rows and fills (h/kh)(w/kw) ``<|media_pad|>`` positions. Each
    row's pads are matched to whole items in order, so a batch whose pads do not add up to its
    items, or an item split across two rows, is a :class:`~k3.errors.K3Error`."""
    kh, kw = merge_kernel_size
    grid = grid_thws.tolist()
    tokens = [(h // kh) * (w // kw) for _, h, w in grid]
    pads = (input_ids == media_pad_token_id).sum(1).tolist()
    bounds, item = [], 0
    for r, n in enumerate(pads):
        first = item
        while n > 0 and item < len(tokens):
            n -= tokens[item]
            item += 1
        if n != 0:
            raise K3Error(f"row {r} holds {pads[r]} <|media_pad|> position(s), which are not whole images of "
                          f"the batch's grid_thws (images {first}..{item - 1})")
        bounds.append((first, item))
    if item != len(tokens):
        raise K3Error(f"the batch has {len(tokens)} image(s) but its <|media_pad|> positions hold {item}")
    lo, hi = bounds[rows.start][0], bounds[rows.stop - 1][1]
    patches = [t * h * w for t, h, w in grid]
    p0, p1 = sum(patches[:lo]), sum(patches[:hi])
    return pixel_values[p0:p1], grid_thws[lo:hi]


class K3VLForConditionalGeneration(nn.Module):
    """The text model plus the MoonViT3d tower and ``patchmergerv2`` projector.

    ``model(input_ids, pixel_values=None, grid_thws=None, labels=None, cache=None,
    logits_to_keep=0, doc_ids=None)`` -> :class:`CausalLMOutput` (the keywords after
    ``grid_thws`` are :meth:`K3ForCausalLM.forward`'s).
    """

    def __init__(self, config: K3Config, media_pad_token_id: int | None = None):
        super().__init__()
        if not isinstance(config, K3Config):
            raise TypeError(f"config must be a K3Config, got {type(config).__name__}")
        vc = vision_config_of(config)
        if vc is None:
            raise ConfigError("K3VLForConditionalGeneration needs a config with a vision_config "
                              "(a text-only config builds K3ForCausalLM)")
        if media_pad_token_id is None:
            media_pad_token_id = media_pad_token_id_of(config)
        check_int("media_pad_token_id", media_pad_token_id, lo=0)
        if media_pad_token_id >= config.vocab_size:
            raise ConfigError(f"media_pad_token_id {media_pad_token_id} is outside the vocabulary "
                              f"[0, {config.vocab_size}); pass media_pad_token_id= for a small tokenizer")
        self.config = config
        self.vision_config = vc
        self.media_pad_token_id = media_pad_token_id
        self.language_model = K3ForCausalLM(config)
        vision = VisionModel(vc)
        self.vision_tower = vision.vision_tower
        self.mm_projector = vision.mm_projector

    def image_features(self, pixel_values: torch.Tensor, grid_thws) -> torch.Tensor:
        """pixel_values [N, 3, p, p], grid_thws [n, 3] -> projected rows [M, H] (items in order)."""
        return self.mm_projector(self.vision_tower(pixel_values, grid_thws))

    def embed(self, input_ids: torch.Tensor, pixel_values: torch.Tensor | None = None,
              grid_thws=None) -> torch.Tensor:
        """Token embeddings [B, T, H] with the image rows at the ``<|media_pad|>`` positions.

        The number of pad positions must equal the number of projected rows (a
        :class:`~k3.errors.K3Error` naming both counts otherwise).
        """
        x = self.language_model.model.embed(input_ids)
        if (pixel_values is None) != (grid_thws is None):
            raise ValueError("pixel_values and grid_thws go together (pass both or neither)")
        is_pad = input_ids == self.media_pad_token_id
        n_pad = int(is_pad.sum()) if input_ids.device.type != "meta" else None
        if pixel_values is None:
            if n_pad:
                raise K3Error(f"input_ids hold {n_pad} <|media_pad|> position(s) (id {self.media_pad_token_id}) "
                              "but no images were given (0 projected rows)")
            return x
        rows = self.image_features(pixel_values, grid_thws)
        if n_pad is not None and n_pad != rows.shape[0]:
            raise K3Error(f"input_ids hold {n_pad} <|media_pad|> position(s) (id {self.media_pad_token_id}) "
                          f"but the images give {rows.shape[0]} projected row(s)")
        return x.index_put((is_pad,), rows.to(x.dtype))

    def forward(self, input_ids: torch.Tensor, pixel_values: torch.Tensor | None = None, grid_thws=None,
                **kw) -> CausalLMOutput:
        """input_ids [B, T]; pixel_values [N, 3, p, p] and grid_thws [n, 3] of the packed images
        (:func:`k3.data.images.preprocess`); ``kw``: labels, cache, logits_to_keep, doc_ids."""
        if "inputs_embeds" in kw:
            raise TypeError("K3VLForConditionalGeneration.forward takes input_ids (and images), "
                            "not inputs_embeds")
        return self.language_model(inputs_embeds=self.embed(input_ids, pixel_values, grid_thws), **kw)

    def new_cache(self, batch_size: int):
        return self.language_model.new_cache(batch_size)

    @property
    def image_proc(self):
        """The image preprocessing this tower reads (:class:`~k3.config.vision.ImageProcConfig`)."""
        return image_proc_for(self.vision_config)

    def moe_layers(self):
        """The text model's MoE layers (the tower has none)."""
        return self.language_model.moe_layers()

    def compile_attn_res(self, on: bool = True) -> "K3VLForConditionalGeneration":
        """The text model's :meth:`K3ForCausalLM.compile_attn_res`. Returns self."""
        self.language_model.compile_attn_res(on)
        return self

    @torch.no_grad()
    def init_weights(self) -> "K3VLForConditionalGeneration":
        """(Re-)initialise every tensor as construction does (after ``to_empty``); returns self."""
        self.language_model.init_weights()
        for part in (self.vision_tower, self.mm_projector):
            for m in part.modules():
                if type(m).__module__.startswith("k3.") and hasattr(m, "reset_parameters"):
                    m.reset_parameters()
        return self

    def vision_state_dict(self) -> dict[str, torch.Tensor]:
        """The vision tensors under their checkpoint names (``vision_tower.…``, ``mm_projector.…``)."""
        return {n: t for n, t in self.state_dict().items() if not n.startswith("language_model.")}
