"""``k3 serve`` through the official ``openai`` client over real HTTP: greedy output equals the
engine's on the same prompt ids, the rendered prompt is the one ChatFormat gives (usage.prompt_tokens),
reasoning and content come back separately (streamed too), the thinking cap of reasoning_effort."""

from __future__ import annotations

import openai
import pytest

from k3.data.chat import ChatFormat
from k3.infer.engine import Engine
from k3.infer.sampling import SamplingParams

USER = [{"role": "user", "content": "hello world"}]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def ref(ckpt):
    """The engine in-process on the same weights: the reference for greedy outputs."""
    _, model, tok = ckpt
    with Engine(model, tokenizer=tok) as eng:
        yield eng, ChatFormat(tok), tok


def ref_chat(ref, messages, n, effort="max", cap=None):
    eng, fmt, _ = ref
    ids = fmt.render(messages, reasoning_effort=effort)
    out = eng.generate([ids], SamplingParams(max_tokens=n, temperature=0, stop_token_ids=(fmt.end_id,),
                                             max_thinking_tokens=cap, think_end_id=fmt.think_end_id))[0]
    return ids, out, fmt.parse(out.token_ids, out.finish_reason)


def test_models(client):
    assert [m.id for m in client.models.list().data] == ["nano"]


def test_chat_greedy_equals_the_engine(client, ref):
    r = client.chat.completions.create(model="nano", messages=USER, max_tokens=12, temperature=0)
    ids, out, want = ref_chat(ref, USER, 12)
    msg = r.choices[0].message
    assert msg.content == want.content and msg.model_extra["reasoning_content"] == want.reasoning
    assert r.choices[0].finish_reason == want.finish_reason
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == len(out.token_ids)


def test_chat_stream_deltas_add_up_and_usage_comes_last(client, ref):
    chunks = list(client.chat.completions.create(model="nano", messages=USER, max_tokens=12, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    _, out, want = ref_chat(ref, USER, 12)
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    reasoning = "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas)
    content = "".join(d.content or "" for d in deltas)
    assert reasoning == want.reasoning and content == want.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == want.finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(out.token_ids)
    assert all(c.usage is None for c in chunks[:-1])


def test_completion_greedy_equals_the_engine(client, ref):
    eng, _, tok = ref
    want = eng.generate([tok.encode("the quick brown")], SamplingParams(max_tokens=10, temperature=0))[0]
    r = client.completions.create(model="nano", prompt="the quick brown", max_tokens=10, temperature=0)
    assert r.choices[0].text == want.text and r.choices[0].finish_reason == want.finish_reason
    assert r.usage.completion_tokens == len(want.token_ids)
    streamed = client.completions.create(model="nano", prompt="the quick brown", max_tokens=10, temperature=0,
                                         stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == want.text


@pytest.mark.parametrize("key", ["reasoning_content", "reasoning"])
def test_history_with_reasoning_is_rendered_with_it(client, ref, key):
    thought = "the user greets; answer kindly"
    history = [*USER, {"role": "assistant", "content": "hi there", key: thought},
               {"role": "user", "content": "the fox?"}]
    r = client.chat.completions.create(model="nano", messages=history, max_tokens=6, temperature=0)
    ids, _, want = ref_chat(ref, history, 6)
    without = [*USER, {"role": "assistant", "content": "hi there"}, {"role": "user", "content": "the fox?"}]
    tok = ref[2]
    assert r.usage.prompt_tokens == len(ids)
    assert r.usage.prompt_tokens == len(ref[1].render(without, reasoning_effort="max")) + len(tok.encode(thought))
    assert r.choices[0].message.model_extra["reasoning_content"] == want.reasoning


def test_effort_low_caps_thinking_and_the_answer_follows(client, ref, server):
    THINK_CAP_LOW = server.cap_low
    n = THINK_CAP_LOW + 5
    r = client.chat.completions.create(model="nano", messages=USER, max_tokens=n, temperature=0,
                                       reasoning_effort="low")
    ids, out, want = ref_chat(ref, USER, n, effort="low", cap=THINK_CAP_LOW)
    assert r.usage.prompt_tokens == len(ids) != len(ref[1].render(USER, reasoning_effort="max"))
    assert out.token_ids[THINK_CAP_LOW] == ref[1].think_end_id  # the cap closed the thinking
    assert r.choices[0].message.model_extra["reasoning_content"] == want.reasoning
    assert r.choices[0].message.content == want.content
    free = client.chat.completions.create(model="nano", messages=USER, max_tokens=n, temperature=0)
    assert free.choices[0].message.model_extra["reasoning_content"] != want.reasoning  # control: no cap at max


def _tool_history(with_reasoning: bool):
    call = {"id": "call_1", "type": "function", "function": {"name": "lookup", "arguments": '{"q": "fox"}'}}
    assistant = {"role": "assistant", "content": "", "tool_calls": [call]}
    if with_reasoning:
        assistant["reasoning_content"] = "I should look it up"
    return [*USER, assistant, {"role": "tool", "tool_call_id": "call_1", "content": "a quick brown fox"}]


TOOLS = [{"type": "function", "function": {"name": "lookup", "description": "search",
                                           "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}}]


def test_tool_round_trip_history_needs_reasoning(client, ref, server):
    ok = client.chat.completions.create(model="nano", messages=_tool_history(True), tools=TOOLS, max_tokens=4,
                                        temperature=0, tool_choice="auto")
    ids = ref[1].render(_tool_history(True), tools=TOOLS, reasoning_effort="max")
    assert ok.usage.prompt_tokens == len(ids)
    with pytest.raises(openai.BadRequestError, match="reasoning"):
        client.chat.completions.create(model="nano", messages=_tool_history(False), tools=TOOLS, max_tokens=4)
    assert server.healthy()


def test_allow_missing_reasoning_flag(keyed_server):
    c = openai.OpenAI(base_url=keyed_server.url + "/v1", api_key="sekrit", max_retries=0, timeout=60)
    r = c.chat.completions.create(model="nano", messages=_tool_history(False), tools=TOOLS, max_tokens=2)
    assert r.usage.completion_tokens >= 1


@pytest.mark.parametrize("choice", ["none", "required", {"type": "function", "function": {"name": "lookup"}}])
def test_tool_choice_values(client, choice):
    r = client.chat.completions.create(model="nano", messages=USER, tools=TOOLS, tool_choice=choice, max_tokens=2)
    assert r.usage.completion_tokens >= 1
    with pytest.raises(openai.BadRequestError, match="tool_choice"):
        client.chat.completions.create(model="nano", messages=USER, tool_choice=choice, max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="not in tools"):
        client.chat.completions.create(model="nano", messages=USER, tools=TOOLS, max_tokens=2,
                                       tool_choice={"type": "function", "function": {"name": "other"}})


@pytest.mark.parametrize("choice", [{"type": "function", "function": {"name": "lookup"}}, "required"])
def test_tool_choice_forces_a_call(client, ref, server, choice):
    """Reference written here on the engine: greedy thinking up to </think> (or <|im_end|>, dropped;
    effort low caps it), then the call start written by the server, then greedy on from there."""
    eng, fmt, tok = ref
    n = 40
    ids = fmt.render(USER, tools=TOOLS, reasoning_effort="low")
    first = eng.generate([ids], SamplingParams(max_tokens=n, temperature=0, max_thinking_tokens=server.cap_low,
                                               think_end_id=fmt.think_end_id,
                                               stop_token_ids=(fmt.end_id, fmt.think_end_id)))[0].token_ids
    if first and first[-1] in (fmt.end_id, fmt.think_end_id):
        first = first[:-1]
    header = "functions.lookup:0" if isinstance(choice, dict) else "functions."
    written = [fmt.think_end_id, fmt.ids["<|tool_calls_section_begin|>"], fmt.ids["<|tool_call_begin|>"],
               *tok.encode(header)] + ([fmt.ids["<|tool_call_argument_begin|>"]] if isinstance(choice, dict) else [])
    rest = eng.generate([ids + first + written], SamplingParams(max_tokens=n - len(first) - len(written),
                                                               temperature=0, stop_token_ids=(fmt.end_id,)))[0]
    want = fmt.parse(first + written + rest.token_ids, rest.finish_reason)
    r = client.chat.completions.create(model="nano", messages=USER, tools=TOOLS, tool_choice=choice, max_tokens=n,
                                       temperature=0, reasoning_effort="low")
    msg = r.choices[0].message
    assert r.usage.completion_tokens == len(first) + len(written) + len(rest.token_ids)
    assert msg.model_extra["reasoning_content"] == want.reasoning and (msg.content or "") == want.content
    assert [c.model_dump() for c in msg.tool_calls or []] == want.tool_calls
    assert r.choices[0].finish_reason == want.finish_reason
    assert header in (msg.content or "") or msg.tool_calls[0].id.startswith(header)
    streamed = client.chat.completions.create(model="nano", messages=USER, tools=TOOLS, tool_choice=choice,
                                              max_tokens=n, temperature=0, stream=True, reasoning_effort="low")
    content = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    assert content == want.content
