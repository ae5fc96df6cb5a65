"""Tool calls in the model's output, in the OpenAI schema, whole and streamed: the response builders
of k3.serve.chat run on scripted token ids (the ids ChatFormat renders for an assistant turn with
calls, i.e. what a model trained on the format writes), through the real parser."""

from __future__ import annotations

import asyncio
import json

import pytest

from k3.data.chat import ChatFormat
from k3.infer.engine import Engine
from k3.infer.scheduler import TokenEvent
from k3.serve.app import Service
from k3.serve.chat import chat_stream, chat_whole

CALLS = [{"id": "functions.lookup:0", "type": "function", "function": {"name": "lookup", "arguments": '{"q":"fox"}'}},
         {"id": "functions.add:1", "type": "function", "function": {"name": "add", "arguments": '{"a":1,"b":2}'}}]


@pytest.fixture(scope="module")
def svc(ckpt):
    _, model, tok = ckpt
    with Engine(model, tokenizer=tok) as eng:
        yield Service(eng, tok, "nano")


def reply_ids(fmt: ChatFormat, message: dict) -> list[int]:
    """The generated part of an assistant turn: its ids after the generation prompt."""
    user = [{"role": "user", "content": "q"}]
    head = fmt.render(user)
    full = fmt.render([*user, message], add_generation_prompt=False)
    assert full[:len(head)] == head
    return full[len(head):]


async def scripted(ids, reason="stop"):
    for j, t in enumerate(ids):
        yield TokenEvent(t, "", None, reason if j == len(ids) - 1 else None)


def run(coro):
    return asyncio.run(coro)


def test_tool_calls_whole(svc):
    msg = {"role": "assistant", "content": "let me check", "reasoning_content": "need tools", "tool_calls": CALLS}
    ids = reply_ids(svc.fmt, msg)
    r = run(chat_whole(svc, None, scripted(ids), "x", 5))
    m = r["choices"][0]["message"]
    assert m["tool_calls"] == CALLS and m["content"] == "let me check" and m["reasoning_content"] == "need tools"
    assert r["choices"][0]["finish_reason"] == "tool_calls" and r["usage"]["completion_tokens"] == len(ids)
    assert all(isinstance(json.loads(c["function"]["arguments"]), dict) for c in m["tool_calls"])


def _chunks(svc, ids):
    async def collect():
        return [x async for x in chat_stream(svc, None, scripted(ids), "x", 5, True)]
    out = run(collect())
    assert out[-1] == "data: [DONE]\n\n"
    return [json.loads(x[6:]) for x in out[:-1]]


def test_tool_calls_streamed(svc):
    msg = {"role": "assistant", "content": "", "reasoning_content": "think", "tool_calls": CALLS}
    chunks = _chunks(svc, reply_ids(svc.fmt, msg))
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    calls = [tc for d in deltas for tc in d.get("tool_calls", [])]
    assert [(c["index"], c["id"], c["function"]) for c in calls] == [(i, c["id"], c["function"])
                                                                     for i, c in enumerate(CALLS)]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "think"
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "tool_calls"
    assert chunks[-1]["usage"]["completion_tokens"] > 0


def test_a_call_that_does_not_parse_is_content_with_stop(svc):
    fmt = svc.fmt
    good = reply_ids(fmt, {"role": "assistant", "content": "", "reasoning_content": "", "tool_calls": CALLS[:1]})
    assert run(chat_whole(svc, None, scripted(good), "x", 5))["choices"][0]["finish_reason"] == "tool_calls"
    bad_args = fmt.tok.encode('{"q": fox')  # not JSON
    arg_at = good.index(fmt.ids["<|tool_call_argument_begin|>"]) + 1
    end_at = good.index(fmt.ids["<|tool_call_end|>"])
    bad = good[:arg_at] + bad_args + good[end_at:]
    r = run(chat_whole(svc, None, scripted(bad), "x", 5))
    m = r["choices"][0]
    assert r["choices"][0]["finish_reason"] == "stop" and "tool_calls" not in m["message"]
    assert '{"q": fox' in m["message"]["content"] and "functions.lookup:0" in m["message"]["content"]
    deltas = [c["choices"][0]["delta"] for c in _chunks(svc, bad) if c["choices"]]
    assert not any("tool_calls" in d for d in deltas)
    assert "".join(d.get("content") or "" for d in deltas) == m["message"]["content"]
