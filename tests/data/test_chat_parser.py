"""The streaming chat parser: events, malformed output as content, render -> parse round trips."""

import json
import re

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from k3.data.chat import ChatFormat
from k3.data.chat_parser import (ContentDelta, ReasoningDelta, ToolCallArgumentsDelta, ToolCallBegin,
                                 ToolCallEnd)
from k3.data.tokenizer import train_tokenizer
from k3.errors import K3Error

TEXT = ("The weather in Paris is sunny; call get_weather with {\"city\": \"Paris\"}. "
        "Grüße, 世界, emoji 🎉 and plain ascii words for merges. ") * 20
MARKERS = ["<|im_system|>", "<|im_user|>", "<|im_assistant|>", "<|im_middle|>", "<|im_end|>",
           "<think>", "</think>", "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>",
           "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>",
           "<|media_placeholder|>", "<|endoftext|>"]


@pytest.fixture(scope="module")
def fmt():
    return ChatFormat(train_tokenizer([TEXT], vocab_size=400))


def gen_ids(fmt, s: str) -> list[int]:
    """A model's output written as a template string (markers become their ids)."""
    return fmt.tok.encode(s, allow_special=True)


def run(fmt, ids, reason=None):
    """Feed ids until the message ends (as the engine stops at <|im_end|>), then finish."""
    p = fmt.parser()
    events = []
    for i in ids:
        if p.ended:
            break
        events += p.feed(i)
    res = p.finish(reason)
    return events + res.tail_events, res


def joined(events, kind, index=None):
    return "".join(e.text for e in events if isinstance(e, kind) and (index is None or e.index == index))


def test_stream_events_of_a_tool_calling_message(fmt):
    ids = gen_ids(fmt, 'Think 世界.</think>Let me check.<|tool_calls_section_begin|>'
                       '<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{"city": "Paris"}'
                       '<|tool_call_end|><|tool_call_begin|>functions.time:1<|tool_call_argument_begin|>{}'
                       '<|tool_call_end|><|tool_calls_section_end|><|im_end|>')
    events, res = run(fmt, ids)
    assert res.reasoning == "Think 世界." == joined(events, ReasoningDelta)
    assert res.content == "Let me check." == joined(events, ContentDelta)
    assert res.tool_calls == [
        {"id": "functions.get_weather:0", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"id": "functions.time:1", "type": "function", "function": {"name": "time", "arguments": "{}"}}]
    assert res.finish_reason == "tool_calls"
    kinds = [type(e) for e in events if not isinstance(e, (ReasoningDelta, ContentDelta, ToolCallArgumentsDelta))]
    assert kinds == [ToolCallBegin, ToolCallEnd, ToolCallBegin, ToolCallEnd]
    assert [e for e in events if isinstance(e, ToolCallBegin)] == [
        ToolCallBegin(0, "functions.get_weather:0", "get_weather"), ToolCallBegin(1, "functions.time:1", "time")]
    assert joined(events, ToolCallArgumentsDelta, 0) == '{"city": "Paris"}'
    assert ToolCallEnd(0, True) in events and ToolCallEnd(1, True) in events


def test_deltas_arrive_token_by_token_and_characters_whole(fmt):
    ids = gen_ids(fmt, "a🎉b</think>x")
    p = fmt.parser()
    per_token = [p.feed(i) for i in ids]
    texts = [e.text for evs in per_token for e in evs if isinstance(e, ReasoningDelta)]
    assert "".join(texts) == "a🎉b" and "\ufffd" not in "".join(texts)
    assert "🎉" in texts or any("🎉" in t for t in texts)
    assert len([evs for evs in per_token if evs]) >= 3  # streamed, not all at the end
    assert p.in_reasoning is False and p.reasoning_tokens == len(ids) - 2


def test_finish_reasons(fmt):
    assert run(fmt, gen_ids(fmt, "r</think>done<|im_end|>"))[1].finish_reason == "stop"
    _, cut = run(fmt, gen_ids(fmt, "still thinking"))
    assert cut.finish_reason == "length" and cut.reasoning == "still thinking" and cut.content == ""
    assert run(fmt, gen_ids(fmt, "r</think>a"), reason="stop")[1].finish_reason == "stop"
    assert run(fmt, gen_ids(fmt, "r</think>a<|endoftext|>"))[1].finish_reason == "stop"


MALFORMED = [  # (generated text, content the parser must return)
    ("</think>x<|tool_calls_section_begin|><|tool_call_begin|>get_weather<|tool_call_argument_begin|>{}"
     "<|tool_call_end|><|tool_calls_section_end|><|im_end|>",
     "x<|tool_call_begin|>get_weather<|tool_call_argument_begin|>{}<|tool_call_end|>"),
    ("</think><|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>"
     "{\"a\": <|tool_call_end|><|im_end|>",
     "<|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{\"a\": <|tool_call_end|>"),
    ("</think><|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>"
     "[1, 2]<|tool_call_end|><|im_end|>",
     "<|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>[1, 2]<|tool_call_end|>"),
    ("</think>ok<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>"
     "{\"a\": 1<|im_end|>",
     "ok<|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{\"a\": 1"),
    ("</think>a <|im_user|> b <think> c <|media_placeholder|><|im_end|>",
     "a <|im_user|> b <think> c <|media_placeholder|>"),
]


@pytest.mark.parametrize("text,content", MALFORMED)
def test_output_that_is_not_a_tool_call_comes_back_as_content(fmt, text, content):
    events, res = run(fmt, gen_ids(fmt, text))
    assert res.tool_calls == [] and res.content == content == joined(events, ContentDelta)
    assert res.finish_reason == "stop"
    # positive control: the well-formed call with the same shape parses as a call
    _, good = run(fmt, gen_ids(fmt, "</think><|tool_calls_section_begin|><|tool_call_begin|>functions.f:0"
                                    '<|tool_call_argument_begin|>{"a": 1}<|tool_call_end|><|im_end|>'))
    assert good.tool_calls[0]["function"] == {"name": "f", "arguments": '{"a": 1}'}


def test_a_rejected_call_retracts_its_index(fmt):
    ids = gen_ids(fmt, "</think><|tool_calls_section_begin|><|tool_call_begin|>functions.f:0"
                       "<|tool_call_argument_begin|>nope<|tool_call_end|><|tool_call_begin|>functions.g:1"
                       "<|tool_call_argument_begin|>{}<|tool_call_end|><|tool_calls_section_end|><|im_end|>")
    events, res = run(fmt, ids)
    assert [c["function"]["name"] for c in res.tool_calls] == ["g"]
    ends = [e for e in events if isinstance(e, ToolCallEnd)]
    assert ends == [ToolCallEnd(0, False), ToolCallEnd(0, True)]
    assert [e.index for e in events if isinstance(e, ToolCallBegin)] == [0, 0]


def test_an_id_the_tokenizer_lacks_reads_as_replacement_character(fmt):
    _, res = run(fmt, [fmt.tok.vocab_size + 3, fmt.ids["</think>"], *gen_ids(fmt, "ok")])
    assert res.reasoning == "\ufffd" and res.content == "ok"


def test_feeding_after_the_end_is_refused(fmt):
    p = fmt.parser()
    p.feed(fmt.ids["</think>"])  # positive control: a token before the end is accepted
    p.feed(fmt.ids["<|im_end|>"])
    with pytest.raises(K3Error, match="already finished"):
        p.feed(fmt.ids["<|im_end|>"])


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_arbitrary_ids_never_raise_and_deltas_add_up(fmt, data):
    # ids past the tokenizer's too: a model may have more embedding rows than the tokenizer has ids
    ids = data.draw(st.lists(st.integers(0, fmt.tok.vocab_size + 8), max_size=60))
    events, res = run(fmt, ids)
    assert joined(events, ReasoningDelta) == res.reasoning
    assert joined(events, ContentDelta) == res.content
    for c in res.tool_calls:
        assert isinstance(json.loads(c["function"]["arguments"]), dict)
        assert re.fullmatch(r"functions\.[A-Za-z0-9_.\-]+:\d+", c["id"])


# ------------------------------------------------------------------ render -> parse round trip
_text = st.lists(st.one_of(st.text(st.characters(blacklist_categories=("Cs",)), max_size=12),
                           st.sampled_from(MARKERS), st.sampled_from(["Paris", " the ", "世界", "🎉"])),
                 max_size=5).map("".join)
_json = st.recursive(st.none() | st.booleans() | st.integers() | _text,
                     lambda c: st.lists(c, max_size=3) | st.dictionaries(_text, c, max_size=3), max_leaves=6)
_args = st.tuples(st.dictionaries(_text, _json, max_size=3), st.booleans()).map(
    lambda t: json.dumps(t[0], ensure_ascii=t[1], indent=None if t[1] else 1))
_name = st.from_regex(r"[A-Za-z0-9_.\-]{1,10}", fullmatch=True)


@st.composite
def conversations(draw):
    msgs = [{"role": "system", "content": draw(_text)}] if draw(st.booleans()) else []
    for _ in range(draw(st.integers(1, 3))):
        msgs.append({"role": "user", "content": draw(_text)})
        calls = [{"id": draw(st.sampled_from(["", "call_1", "functions.x:5"])), "type": "function",
                  "function": {"name": draw(_name), "arguments": draw(_args)}}
                 for _ in range(draw(st.integers(0, 3)))]
        msg = {"role": "assistant", "reasoning_content": draw(_text), "content": draw(_text)}
        if calls:
            for c in calls:
                if not c["id"]:
                    del c["id"]
            msg["tool_calls"] = calls
        msgs.append(msg)
        for c in calls:
            if "id" in c:
                msgs.append({"role": "tool", "tool_call_id": c["id"], "content": draw(_text)})
    tools = [{"type": "function", "function": {"name": draw(_name)}}] if draw(st.booleans()) else None
    return msgs, tools, draw(st.sampled_from([None, "low", "high", "max"]))


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(conv=conversations())
@example(conv=(  # empty reasoning, three calls (one foreign id, one model id, one without), unicode
    [{"role": "user", "content": "天気? 🎉"},
     {"role": "assistant", "reasoning_content": "", "content": "", "tool_calls": [
         {"id": "call_1", "type": "function", "function": {"name": "a", "arguments": '{"k": "é"}'}},
         {"id": "functions.x:5", "type": "function", "function": {"name": "x", "arguments": "{}"}},
         {"type": "function", "function": {"name": "b.c", "arguments": '{"n": [1, null]}'}}]},
     {"role": "tool", "tool_call_id": "call_1", "content": "<|im_end|>"},
     {"role": "tool", "tool_call_id": "functions.x:5", "content": ""},
     {"role": "assistant", "reasoning_content": "世界", "content": "<think>done</think>"}],
    [{"type": "function", "function": {"name": "a"}}], "low"))
def test_render_parse_round_trip(fmt, conv):
    msgs, tools, effort = conv
    n_calls = 0
    for k, m in enumerate(msgs):
        if m["role"] != "assistant":
            continue
        prompt = fmt.render(msgs[:k], tools=tools, reasoning_effort=effort)
        full = fmt.render(msgs[:k + 1], tools=tools, reasoning_effort=effort, add_generation_prompt=False)
        assert full[:len(prompt)] == prompt  # the prompt is a prefix of the rendered reply
        events, res = run(fmt, full[len(prompt):])
        assert res.reasoning == m["reasoning_content"] and res.content == m["content"]
        want = []
        for c in m.get("tool_calls", []):
            name = c["function"]["name"]
            kept = c.get("id") == f"functions.{name}:5"  # an id already in the model's form stays
            want.append({"id": c["id"] if kept else f"functions.{name}:{n_calls}", "type": "function",
                         "function": {"name": name, "arguments": c["function"]["arguments"]}})
            n_calls += 1
        assert res.tool_calls == want
        assert res.finish_reason == ("tool_calls" if want else "stop")
        assert joined(events, ReasoningDelta) == res.reasoning and joined(events, ContentDelta) == res.content
        for i, c in enumerate(want):
            assert joined(events, ToolCallArgumentsDelta, i) == c["function"]["arguments"]
