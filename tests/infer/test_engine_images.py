"""Images through the engine (issue 34): chunked prefill with image rows equals the model's one
forward over the whole prompt; the prefix cache tells images apart by content; bad input fails
the request alone, with a positive control beside each refusal.

The reference is ``K3VLForConditionalGeneration.forward`` (input_ids + pixel_values at once: the
tower over every image, rows placed by its own index_put), not the engine's per-chunk placement.
"""

from __future__ import annotations

import pytest
import torch
from PIL import Image

from k3.data.chat import ChatFormat
from k3.data.images import preprocess
from k3.errors import K3Error
from k3.infer.engine import Engine
from k3.infer.sampling import SamplingParams

TEXT = "what colour is this image? red green blue. the answer is red. "


@pytest.fixture(scope="module")
def vl(tmp_path_factory, make_nano_vl_checkpoint):
    return make_nano_vl_checkpoint(tmp_path_factory.mktemp("vl") / "nano-vl", TEXT)


def _chat(fmt, *images, text="what colour?"):
    parts = [{"type": "text", "text": text}]
    for im in images:
        parts.append({"type": "image_url", "image_url": {"url": im}})
    return fmt.render_chat([{"role": "user", "content": parts}])


def _url(size, colour):
    import base64
    import io
    buf = io.BytesIO()
    Image.new("RGB", size, colour).save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _reference_greedy(model, ids, images, n):
    """Greedy tokens by recomputing the whole sequence with the model's own forward each step."""
    pv, g, _ = preprocess(images, model.image_proc)
    seq, out = list(ids), []
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([seq]), pixel_values=pv, grid_thws=g).logits[0, -1]
            out.append(int(logits.argmax()))
            seq.append(out[-1])
    return out


@pytest.mark.parametrize("chunk", [512, 7])   # whole prompt; chunks that cut through the image pads
def test_engine_with_images_equals_the_models_forward(vl, chunk):
    _, model, tok = vl
    fmt = ChatFormat(tok, model.image_proc)
    r = _chat(fmt, _url((70, 40), (250, 0, 0)), _url((30, 30), (0, 0, 250)))
    images = [im.image for im in r.images]
    assert r.ids.count(tok.token_to_id("<|media_pad|>")) == 3 * 2 + 2 * 2
    want = _reference_greedy(model, r.ids, images, 6)
    with Engine(model, tokenizer=tok, prefill_chunk=chunk) as eng:
        got = eng.submit(r.ids, SamplingParams(max_tokens=6, temperature=0), images=images).result()
    assert got.token_ids == want


def test_prefix_cache_keys_images_by_content(vl):
    _, model, tok = vl
    fmt = ChatFormat(tok, model.image_proc)
    red, blue = _chat(fmt, _url((56, 56), (250, 0, 0))), _chat(fmt, _url((56, 56), (0, 0, 250)))
    assert red.ids == blue.ids                       # same size: the same token ids
    p = SamplingParams(max_tokens=4, temperature=0)
    with Engine(model, tokenizer=tok, prefix_cache_bytes=1 << 24, cache_block=8) as eng:
        first = eng.submit(red.ids, p, images=[red.images[0].image]).result()
        before = eng.stats()["prefix_hit_tokens"]
        other = eng.submit(blue.ids, p, images=[blue.images[0].image]).result()
        after_other = eng.stats()["prefix_hit_tokens"]
        again = eng.submit(red.ids, p, images=[red.images[0].image]).result()
        after_again = eng.stats()["prefix_hit_tokens"]
    first_pad = red.ids.index(tok.token_to_id("<|media_pad|>"))
    # the blue image reuses at most the text before its first pad, the red one its whole prompt
    assert after_other - before <= first_pad
    assert after_again - after_other >= len(red.ids) - 8      # positive control: the same image hits
    assert again.token_ids == first.token_ids
    assert other.token_ids == _reference_greedy(model, blue.ids, [blue.images[0].image], 4)


def test_bad_image_requests_fail_alone(vl, make_nano_checkpoint, tmp_path):
    _, model, tok = vl
    fmt = ChatFormat(tok, model.image_proc)
    r = _chat(fmt, _url((28, 28), (0, 200, 0)))
    p = SamplingParams(max_tokens=2, temperature=0)
    with Engine(model, tokenizer=tok) as eng:
        with pytest.raises(K3Error, match="holds 1 <.media_pad.> token.* 2 image.* give 2 row"):
            eng.submit(r.ids, p, images=[r.images[0].image] * 2).result()
        with pytest.raises(K3Error, match="holds <.media_pad.> tokens .* but no images were given"):
            eng.submit(r.ids, p).result()
        with pytest.raises(K3Error, match="corrupt or unrecognised"):
            eng.submit(r.ids, p, images=[b"not an image"]).result()
        assert len(eng.submit(r.ids, p, images=[r.images[0].image]).result().token_ids) == 2  # control
    _, text_model, text_tok = make_nano_checkpoint(tmp_path / "text", TEXT)
    with Engine(text_model, tokenizer=text_tok) as eng:
        with pytest.raises(K3Error, match="this model has no vision tower"):
            eng.submit([1, 2, 3], p, images=[r.images[0].image]).result()
        assert len(eng.submit([1, 2, 3], p).result().token_ids) == 2                     # control


def test_the_local_agent_provider_sends_a_messages_images(vl):
    """``LocalEngine`` (the harness's in-process provider) renders image parts and hands the engine
    their pixels: its reply's tokens are the model's own greedy tokens on that prompt and image."""
    from k3.agent.providers import LocalEngine, ProviderRequest
    from k3.agent.randomize import HarnessConfig

    _, model, tok = vl
    url = _url((50, 40), (10, 200, 10))
    msgs = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": "what colour?"}]}]
    with Engine(model, tokenizer=tok) as eng:
        p = LocalEngine(eng, name="nano-vl")
        r = p.complete(ProviderRequest(msgs, [], HarnessConfig(), max_tokens=4, temperature=0.0, seed=0,
                                       effort="low"))
    chat = ChatFormat(tok, model.image_proc).render_chat(msgs, reasoning_effort="low")
    assert r.sample["prompt_ids"] == chat.ids
    assert r.sample["token_ids"] == _reference_greedy(model, chat.ids, [chat.images[0].image], len(r.sample["token_ids"]))
