"""``k3 serve`` scores given tokens (a remote teacher's job, SPEC §10): /v1/completions with ``echo``
and ``logprobs`` returns every prompt token's logprob, equal to the plain forward of the same
weights on the same ids (independent of the engine), its top alternatives, and the generated
tokens' logprobs after it; ``max_tokens`` 0 scores the prompt only. The engine's
``prompt_logprobs`` equals that forward whatever the prefill chunking. Bad combinations: 400
naming the field."""

from __future__ import annotations

import openai
import pytest
import torch

from k3.infer.engine import Engine

PROMPT = "the quick brown fox jumps over the lazy dog"


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def _forward_logprobs(model, ids: list[int]) -> list[float]:
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
    return [float(lp[i, ids[i + 1]]) for i in range(len(ids) - 1)]


def test_echo_scores_the_prompt_as_the_plain_forward(client, ckpt):
    _, model, tok = ckpt
    ids = tok.encode(PROMPT)
    want = _forward_logprobs(model.eval(), ids)
    r = client.completions.create(model="nano", prompt=ids, max_tokens=0, echo=True, logprobs=2, temperature=0)
    lp = r.choices[0].logprobs
    assert r.choices[0].text == tok.decode(ids) and r.usage.completion_tokens == 0
    assert len(lp.token_logprobs) == len(ids) and lp.token_logprobs[0] is None
    assert max(abs(a - b) for a, b in zip(lp.token_logprobs[1:], want)) <= 1e-4
    assert lp.tokens == [tok.decode([i]) for i in ids]
    assert all(len(t) <= 2 for t in lp.top_logprobs[1:])
    # the top alternative is at least as likely as the token itself
    assert all(max(t.values()) >= v - 1e-6 for t, v in zip(lp.top_logprobs[1:], lp.token_logprobs[1:]))
    # generated tokens follow the prompt's, with their own logprobs (positive control: the same
    # request generating 3 tokens)
    g = client.completions.create(model="nano", prompt=ids, max_tokens=3, echo=True, logprobs=0, temperature=0)
    glp = g.choices[0].logprobs
    assert len(glp.token_logprobs) == len(ids) + 3 and glp.token_logprobs[0] is None
    assert max(abs(a - b) for a, b in zip(glp.token_logprobs[1:len(ids)], lp.token_logprobs[1:])) <= 1e-5
    full = ids + glp.token_ids[len(ids):]
    gen = glp.token_logprobs[len(ids):]
    assert max(abs(a - b) for a, b in zip(gen, _forward_logprobs(model, full)[len(ids) - 1:])) <= 1e-4


def test_bad_combinations_are_400_naming_the_field(client):
    with pytest.raises(openai.BadRequestError, match="echo"):
        client.completions.create(model="nano", prompt="the", max_tokens=0, temperature=0)
    with pytest.raises(openai.BadRequestError, match="stream"):
        list(client.completions.create(model="nano", prompt="the", max_tokens=2, echo=True, logprobs=1, stream=True))
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="nano", prompt="the", max_tokens=2, logprobs=21)


@pytest.mark.parametrize("chunk", [512, 5, "last token alone"])
def test_engine_prompt_logprobs_equal_the_forward_whatever_the_chunking(ckpt, chunk):
    """"last token alone": the prompt's last chunk is its last token, which predicts no prompt
    token (as a prompt one token past a prefix-cache block boundary is cut)."""
    _, model, tok = ckpt
    ids = tok.encode(PROMPT * 2)
    if chunk == "last token alone":
        chunk = len(ids) - 1
    want = _forward_logprobs(model.eval(), ids)
    with Engine(model, tokenizer=tok, prefill_chunk=chunk, prefix_cache_bytes=1 << 20) as eng:
        first = eng.generate([ids], {"max_tokens": 1, "temperature": 0})[0]   # fills the prefix cache
        c = eng.generate([ids], {"max_tokens": 1, "temperature": 0, "prompt_logprobs": 0})[0]
    assert first.prompt_logprobs is None                # control: not asked, not computed
    got = [v for v, _ in c.prompt_logprobs[1:]]
    assert c.prompt_logprobs[0] is None and len(got) == len(want)
    assert max(abs(a - b) for a, b in zip(got, want)) <= 1e-4
