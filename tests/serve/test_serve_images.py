"""Images over the API (issue 34): the official ``openai`` client sends image_url content parts to
``k3 serve`` on a vision checkpoint; greedy output equals the model's own forward on the same
prompt and pixels; each bad image is a 400 naming its part; a text-only server refuses images.
"""

from __future__ import annotations

import base64
import io
import math

import openai
import pytest
import torch
from PIL import Image

from k3.data.chat import ChatFormat
from k3.data.images import preprocess
from k3.serve.launch import launch

TEXT = "what colour is this image? red green blue. the answer is red. "


def _url(size, colour, fmt="PNG"):
    buf = io.BytesIO()
    Image.new("RGB", size, colour).save(buf, fmt)
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(buf.getvalue()).decode()


@pytest.fixture(scope="module")
def vl(tmp_path_factory, make_nano_vl_checkpoint):
    return make_nano_vl_checkpoint(tmp_path_factory.mktemp("serve-vl") / "nano-vl", TEXT)


@pytest.fixture(scope="module")
def client(vl):
    with launch(vl[0], threads=1) as s:
        yield openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def _messages(url):
    return [{"role": "user", "content": [{"type": "text", "text": "what colour?"},
                                         {"type": "image_url", "image_url": {"url": url}}]}]


def test_an_image_message_through_the_openai_client(client, vl):
    _, model, tok = vl
    url = _url((60, 30), (250, 10, 10))
    r = client.chat.completions.create(model="nano-vl", messages=_messages(url), max_tokens=5, temperature=0,
                                       reasoning_effort="max")
    fmt = ChatFormat(tok, model.image_proc)
    chat = fmt.render_chat(_messages(url), reasoning_effort="max")
    assert r.usage.prompt_tokens == len(chat.ids)
    assert chat.ids.count(tok.token_to_id("<|media_pad|>")) == math.ceil(60 / 28) * math.ceil(30 / 28)
    pv, g, _ = preprocess([chat.images[0].image], model.image_proc)
    seq, want = list(chat.ids), []
    with torch.no_grad():
        for _ in range(r.usage.completion_tokens):
            want.append(int(model(torch.tensor([seq]), pixel_values=pv, grid_thws=g).logits[0, -1].argmax()))
            seq.append(want[-1])
    got = fmt.parse(want)
    assert (r.choices[0].message.content or "") == got.content
    assert r.choices[0].message.model_extra.get("reasoning_content", "") == got.reasoning


@pytest.mark.parametrize("url,match", [
    ("data:image/png;base64,AAAA", "corrupt or unrecognised image data"),
    ("https://example.com/cat.png", "remote URLs are not fetched"),
    ("data:image/tiff;base64,AAAA", "unsupported data URL type image/tiff"),
    ("/no/such/file.png", "cannot read the file"),
])
def test_each_bad_image_is_a_400_naming_its_part(client, url, match):
    good = client.chat.completions.create(model="nano-vl", messages=_messages(_url((28, 28), (0, 0, 0))),
                                          max_tokens=1, temperature=0)
    assert good.choices[0].finish_reason                                   # positive control
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="nano-vl", messages=_messages(url), max_tokens=1)
    assert e.value.status_code == 400
    assert "messages[0].content[1]" in e.value.message and match in e.value.message


def test_a_text_only_server_refuses_an_image(server):
    c = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    text = [{"role": "user", "content": [{"type": "text", "text": "hello"}]}]
    assert c.chat.completions.create(model="nano", messages=text, max_tokens=1).choices  # control
    with pytest.raises(openai.BadRequestError, match="has no vision tower"):
        c.chat.completions.create(model="nano", messages=_messages(_url((28, 28), (0, 0, 0))), max_tokens=1)
