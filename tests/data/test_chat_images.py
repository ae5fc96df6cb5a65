"""Images in the chat renderer (issue 34): the release's media block, in place, ids written out here.

N (the pad count) is computed in this file from the research note's rule — resize only above the
limits, pad each side up to a multiple of 28 px, one token per 28 × 28 cell — not by
``ImageProcConfig.num_tokens``. Every refusal has a positive control beside it.
"""

from __future__ import annotations

import base64
import io
import math

import pytest
from PIL import Image

from k3.config.vision import ImageProcConfig
from k3.data.chat import ChatFormat
from k3.data.tokenizer import MEDIA_TOKENS, SPECIAL_TOKENS, train_tokenizer
from k3.errors import K3Error

TEXT = "What colour is the square? It is red. image 60x40 count the circles: three. " * 30
MEDIA = ["<|media_begin|>", "<|media_content|>", "<|media_end|>", "<|media_pad|>"]  # release names


@pytest.fixture(scope="module")
def tok():
    return train_tokenizer([TEXT], vocab_size=400)


@pytest.fixture(scope="module")
def fmt(tok):
    return ChatFormat(tok, ImageProcConfig())


def _data_url(w: int, h: int, colour=(200, 10, 10), fmt: str = "PNG") -> str:
    buf = io.BytesIO()
    Image.new("RGB", (w, h), colour).save(buf, fmt)
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(buf.getvalue()).decode()


def _pads(w: int, h: int) -> int:
    return math.ceil(w / 28) * math.ceil(h / 28)


def _image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def test_media_tokens_follow_the_chat_tokens_in_the_file(tok, tmp_path):
    from k3.data.tokenizer import Tokenizer

    assert [tok.token_to_id(t) for t in MEDIA] == [14, 15, 16, 17]
    back = Tokenizer.load(tok.save(tmp_path))
    assert back.media_token_ids == dict(zip(MEDIA, [14, 15, 16, 17]))
    assert tuple(MEDIA) == MEDIA_TOKENS


def test_an_image_renders_in_place_as_the_release_block(fmt, tok):
    msgs = [{"role": "user", "content": [{"type": "text", "text": "What colour is "},
                                         _image_part(_data_url(60, 40)),
                                         {"type": "text", "text": "the square?"}]}]
    r = fmt.render_chat(msgs)
    t = tok.token_to_id
    want = ([t("<|im_user|>"), *tok.encode("user"), t("<|im_middle|>"), *tok.encode("What colour is "),
             t("<|media_begin|>"), *tok.encode("image 60x40"), t("<|media_content|>"),
             *[t("<|media_pad|>")] * _pads(60, 40), t("<|media_end|>"), *tok.encode("the square?"),
             t("<|im_end|>")] + fmt.generation_prompt())
    assert _pads(60, 40) == 6
    assert r.ids == want
    assert sum(r.mask) == 0                      # a user turn trains nothing
    assert [(im.size, im.num_tokens, im.where) for im in r.images] == [((60, 40), 6, "messages[0].content[1]")]
    assert r.images[0].image.getpixel((0, 0)) == (200, 10, 10)


def test_images_keep_prompt_order_across_user_and_tool_messages(fmt, tok, tmp_path):
    Image.new("RGB", (30, 90), (0, 0, 255)).save(tmp_path / "b.png")
    msgs = [{"role": "user", "content": [_image_part(_data_url(100, 20)), {"type": "text", "text": "and"},
                                         _image_part("b.png")]},
            {"role": "assistant", "reasoning_content": "look", "content": "",
             "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "shot", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": [_image_part(_data_url(28, 28))]}]
    r = fmt.render_chat(msgs, base_dir=tmp_path)
    assert [im.size for im in r.images] == [(100, 20), (30, 90), (28, 28)]
    pad = tok.token_to_id("<|media_pad|>")
    assert r.ids.count(pad) == _pads(100, 20) + _pads(30, 90) + _pads(28, 28) == 4 + 8 + 1
    begins = [i for i, x in enumerate(r.ids) if x == tok.token_to_id("<|media_begin|>")]
    assert len(begins) == 3 and begins == sorted(begins)
    # the tool result keeps its header text before the image
    tool_at = max(i for i, x in enumerate(r.ids) if x == tok.token_to_id("<|im_system|>"))
    head = tok.decode(r.ids[tool_at:begins[2]])
    assert head.endswith("Result of functions.shot:0\n")


def test_text_parts_render_as_before_and_render_refuses_an_image_chat(fmt, tok):
    parts = [{"role": "user", "content": [{"type": "text", "text": "count "}, {"type": "text", "text": "them"}]}]
    assert fmt.render(parts) == fmt.render([{"role": "user", "content": "count them"}]) \
        == fmt.render_chat(parts).ids
    with_image = [{"role": "user", "content": [_image_part(_data_url(10, 10))]}]
    with pytest.raises(K3Error, match=r"messages\[0\]\.content\[0\] is an image: render this chat with render_chat"):
        fmt.render(with_image)
    assert len(fmt.render_chat(with_image).images) == 1  # positive control


BAD_PARTS = [
    ({"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}, "remote URLs are not fetched"),
    ({"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}, "corrupt or unrecognised"),
    ({"type": "image_url", "image_url": {"url": "data:image/tiff;base64,AAAA"}}, "unsupported data URL type"),
    ({"type": "image_url", "image_url": {"url": "missing.png"}}, "cannot read the file"),
    ({"type": "image_url", "image_url": {"url": ""}}, "url must be a non-empty string"),
    ({"type": "image_url", "image_url": {"url": "x", "detail": "high"}}, "detail 'high' is not supported"),
    ({"type": "image_url", "image_url": {"url": "x", "size": 3}}, r"unknown fields \['size'\]"),
]


@pytest.mark.parametrize("part,match", BAD_PARTS)
def test_a_bad_image_part_is_refused_naming_it(fmt, tmp_path, part, match):
    good = {"type": "image_url", "image_url": {"url": _data_url(20, 20), "detail": "auto"}}
    assert fmt.render_chat([{"role": "user", "content": [good]}], base_dir=tmp_path).images  # control
    with pytest.raises(K3Error, match=r"messages\[0\]\.content\[1\]") as e:
        fmt.render_chat([{"role": "user", "content": [good, part]}], base_dir=tmp_path)
    assert e.match(match)


def test_images_only_where_they_belong(fmt, tok):
    img = _image_part(_data_url(20, 20))
    with pytest.raises(K3Error, match=r"messages\[0\]\.content\[0\]: an image part is not allowed"):
        fmt.render_chat([{"role": "system", "content": [img]}])
    with pytest.raises(K3Error, match=r"messages\[1\]\.content\[0\]: an image part is not allowed"):
        fmt.render_chat([{"role": "user", "content": "hi"},
                         {"role": "assistant", "reasoning_content": "", "content": [img]}])
    assert fmt.render_chat([{"role": "user", "content": [img]}]).images  # positive control
    text_only = ChatFormat(tok)                                            # no vision tower
    with pytest.raises(K3Error, match="has no vision tower"):
        text_only.render_chat([{"role": "user", "content": [img]}])


def test_a_tokenizer_from_before_vision_renders_text_and_refuses_images():
    old = train_tokenizer([TEXT], vocab_size=400, special_tokens=[t for t in SPECIAL_TOKENS if t not in MEDIA])
    assert old.media_token_ids is None and old.chat_token_ids is not None
    assert ChatFormat(old).render([{"role": "user", "content": "hi"}])  # positive control: text chats
    with pytest.raises(K3Error, match="tokenizer has no media tokens"):
        ChatFormat(old, ImageProcConfig())
