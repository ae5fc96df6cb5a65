"""K3VLForConditionalGeneration (SPEC §3.9 placement) against an independent computation.

The reference embeds the text by indexing the embedding weight, runs a separately built
VisionModel holding the same tensors, writes its rows into the pad positions by an explicit loop
over (row, position), then runs the language model on those embeddings. Without images and pad
tokens the VL model must be the text model bit for bit. Every refusal has a positive control.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from PIL import Image

from k3.config import get_preset
from k3.data.images import preprocess
from k3.errors import ConfigError, K3Error
from k3.model.decoder import K3ForCausalLM
from k3.model.multimodal import K3VLForConditionalGeneration, media_pad_token_id_of
from k3.model.vision import VisionModel
from k3.config.presets import vision_preset
from k3.config.vision import ImageProcConfig

PAD = 7  # <|media_pad|> for the nano tokenizer-sized vocabulary (512)


def vl_config(**wrapper):
    cfg = dataclasses.replace(get_preset("nano"), vision_config=vision_preset("nano").to_dict())
    if wrapper:
        cfg.wrapper = dict(wrapper)
    return cfg


def random_vl(seed: int = 0) -> K3VLForConditionalGeneration:
    torch.manual_seed(seed)
    model = K3VLForConditionalGeneration(vl_config(), media_pad_token_id=PAD)
    with torch.no_grad():
        for t in model.state_dict().values():
            t.copy_(torch.randn_like(t) * 0.05)
    return model.eval()


def two_images():
    """Two images of different sizes through the real preprocessing: 60×40 px -> grid (1, 4, 6),
    6 merged tokens; 30×16 px -> grid (1, 2, 4), 2 tokens."""
    rng = np.random.default_rng(0)
    ims = [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for w, h in ((60, 40), (30, 16))]
    pixel_values, grid_thws, sizes = preprocess(ims, ImageProcConfig())
    assert grid_thws.tolist() == [[1, 4, 6], [1, 2, 4]] and sizes == [(60, 40), (30, 16)]
    return pixel_values, grid_thws


def prompt() -> torch.Tensor:
    """Two rows: image 1's 6 pads in row 0, image 2's 2 pads in row 1."""
    ids = torch.randint(PAD + 1, 512, (2, 16), generator=torch.Generator().manual_seed(1))
    ids[0, 3:9] = PAD
    ids[1, 4:6] = PAD
    return ids


def reference_logits(model: K3VLForConditionalGeneration, ids, pixel_values, grid_thws) -> torch.Tensor:
    lm = model.language_model
    x = lm.model.embed_tokens.weight[ids]                                     # [B, T, H] by hand
    vision = VisionModel(model.vision_config)
    vision.load_state_dict(model.vision_state_dict())                       # same tensors, own module
    rows = vision(pixel_values, grid_thws)
    k = 0
    for b in range(ids.shape[0]):
        for t in range(ids.shape[1]):
            if int(ids[b, t]) == PAD:
                x[b, t] = rows[k]
                k += 1
    assert k == rows.shape[0]
    return lm(inputs_embeds=x).logits


@torch.no_grad()
def test_images_replace_pad_embeddings_in_order():
    model = random_vl()
    pixel_values, grid_thws = two_images()
    ids = prompt()
    assert int((ids == PAD).sum()) == 8
    got = model(ids, pixel_values, grid_thws).logits
    want = reference_logits(model, ids, pixel_values, grid_thws)
    assert got.shape == (2, 16, 512)
    assert torch.equal(got, want)
    # the images matter: the same prompt with the pad embeddings left in place differs
    plain = model.language_model(ids).logits
    assert not torch.allclose(got, plain)
    # and so does their order: image rows swapped between the two items
    swapped = reference_logits(model, ids, *_swap(pixel_values, grid_thws))
    assert not torch.allclose(got[0, 3:], swapped[0, 3:])


def _swap(pixel_values, grid_thws):
    n0 = int(grid_thws[0].prod())
    return torch.cat([pixel_values[n0:], pixel_values[:n0]]), grid_thws.flip(0)


def test_images_across_rows_and_gradients_reach_the_tower():
    model = random_vl().train()
    pixel_values, grid_thws = two_images()
    ids2 = prompt()  # image 1 split across the rows (4 pads ending row 0, 2 starting row 1), then image 2
    ids2[0, 3:9] = 100
    ids2[0, 12:16] = PAD
    ids2[1, 0:2] = PAD
    ids2[1, 4:6] = PAD
    assert int((ids2 == PAD).sum()) == 8
    with torch.no_grad():
        assert torch.equal(model(ids2, pixel_values, grid_thws).logits,
                           reference_logits(model, ids2, pixel_values, grid_thws))
    out = model(ids2, pixel_values, grid_thws, labels=ids2)
    out.loss.backward()
    for name in ("vision_tower.encoder.blocks.0.wqkv.weight", "mm_projector.proj.0.weight",
                 "vision_tower.patch_embed.proj.weight", "language_model.model.embed_tokens.weight"):
        g = dict(model.named_parameters())[name].grad
        assert g is not None and g.abs().sum() > 0, name


@torch.no_grad()
def test_no_images_is_the_text_model_bit_for_bit():
    model = random_vl()
    text = K3ForCausalLM(model.config).eval()
    text.load_state_dict(model.language_model.state_dict())
    ids = torch.randint(PAD + 1, 512, (2, 12), generator=torch.Generator().manual_seed(2))
    a, b = model(ids, labels=ids), text(ids, labels=ids)
    assert torch.equal(a.logits, b.logits) and torch.equal(a.loss, b.loss)
    # the inputs_embeds path of the text model is the ids path, bit for bit
    assert torch.equal(text(inputs_embeds=text.model.embed(ids)).logits, b.logits)
    # with a cache: prefill then one decode step, VL and text model alike
    ca, cb = model.new_cache(2), text.new_cache(2)
    for chunk in (ids[:, :9], ids[:, 9:10]):
        assert torch.equal(model(chunk, cache=ca).logits, text(chunk, cache=cb).logits)


def test_inputs_embeds_refusals():
    text = K3ForCausalLM(get_preset("nano"))
    ids = torch.randint(0, 512, (1, 4))
    with pytest.raises(ValueError, match="exactly one of input_ids and inputs_embeds"):
        text(ids, inputs_embeds=text.model.embed(ids))
    with pytest.raises(ValueError, match="exactly one of input_ids and inputs_embeds"):
        text()
    with pytest.raises(ValueError, match=r"inputs_embeds must be \[batch, seq, 64\]"):
        text(inputs_embeds=torch.zeros(1, 4, 32))
    with pytest.raises(ValueError, match="labels shape"):
        text(inputs_embeds=text.model.embed(ids), labels=ids[:, :3])
    assert text(inputs_embeds=text.model.embed(ids), labels=ids).loss is not None  # control


@torch.no_grad()
def test_pad_count_mismatch_is_refused_naming_both_counts():
    model = random_vl()
    pixel_values, grid_thws = two_images()
    ids = prompt()
    assert model(ids, pixel_values, grid_thws).logits.shape == (2, 16, 512)  # control: 8 pads, 8 rows
    short = ids.clone()
    short[0, 3] = 100
    with pytest.raises(K3Error, match=r"7 <\|media_pad\|> position\(s\).*8 projected row"):
        model(short, pixel_values, grid_thws)
    extra = ids.clone()
    extra[1, 0] = PAD
    with pytest.raises(K3Error, match=r"9 <\|media_pad\|> position\(s\).*8 projected row"):
        model(extra, pixel_values, grid_thws)
    with pytest.raises(K3Error, match=r"8 <\|media_pad\|> position\(s\).*no images"):
        model(ids)
    with pytest.raises(ValueError, match="pixel_values and grid_thws go together"):
        model(ids, pixel_values)


def test_media_pad_token_id_from_config_or_constructor():
    assert media_pad_token_id_of(get_preset("k3")) == 163605  # the release's <|media_pad|>
    assert media_pad_token_id_of(vl_config(model_type="kimi_k3", media_placeholder_token_id=11)) == 11
    assert K3VLForConditionalGeneration(vl_config(media_placeholder_token_id=11)).media_pad_token_id == 11
    assert K3VLForConditionalGeneration(vl_config(media_placeholder_token_id=11),
                                        media_pad_token_id=5).media_pad_token_id == 5
    with pytest.raises(ConfigError, match=r"media_pad_token_id 163605 is outside the vocabulary \[0, 512\)"):
        K3VLForConditionalGeneration(vl_config())  # nano's vocabulary has no id 163605
    with pytest.raises(ConfigError, match="needs a config with a vision_config"):
        K3VLForConditionalGeneration(get_preset("nano"), media_pad_token_id=PAD)


def test_submodule_names_are_the_release_checkpoint_names():
    names = set(random_vl().state_dict())
    for n in ("language_model.model.embed_tokens.weight", "language_model.lm_head.weight",
              "vision_tower.patch_embed.proj.weight", "vision_tower.patch_embed.pos_emb.weight",
              "vision_tower.encoder.blocks.0.wqkv.weight", "vision_tower.encoder.blocks.1.mlp.fc1.weight",
              "vision_tower.encoder.final_layernorm.weight", "mm_projector.proj.0.weight",
              "mm_projector.proj.2.weight", "mm_projector.post_norm.weight"):
        assert n in names, n
    assert all(n.startswith(("language_model.", "vision_tower.", "mm_projector.")) for n in names)
