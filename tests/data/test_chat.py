"""The chat renderer of SPEC §6.3: exact ids, SFT masks, preserved thinking, refusals."""

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from k3.data.chat import ChatFormat, thinking_budget
from k3.data.tokenizer import train_tokenizer
from k3.errors import K3Error

TEXT = ("You are K3, a helpful assistant. The weather in Paris is sunny today; tomorrow rain. "
        "def get_weather(city): return 'sunny'\n{\"city\": \"Paris\", \"unit\": \"C\"}\n"
        "Grüße aus München, 世界你好, emoji 🎉. ") * 20
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather now",
                                            "parameters": {"type": "object", "properties": {}}}}


@pytest.fixture(scope="module")
def tok():
    return train_tokenizer([TEXT], vocab_size=420)


@pytest.fixture(scope="module")
def fmt(tok):
    return ChatFormat(tok)


def conversation():
    return [
        {"role": "system", "content": "You are K3."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "reasoning_content": "I should call the tool.", "content": "Checking.",
         "tool_calls": [{"id": "call_abc", "type": "function",
                         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_abc", "content": "sunny"},
        {"role": "assistant", "reasoning": "Got it.", "content": "It is sunny."},
    ]


def test_render_matches_the_spec_template_written_out(fmt, tok):
    # SPEC §6.3 spelled by hand; encode(allow_special) turns the marker strings into their ids.
    want = ("<|im_system|>system<|im_middle|>You are K3.\n\n# Tools\n"
            '{"description":"Weather now","name":"get_weather","parameters":{"properties":{},"type":"object"}}'
            "\n\n# Reasoning effort: low<|im_end|>"
            "<|im_user|>user<|im_middle|>Weather in Paris?<|im_end|>"
            "<|im_assistant|>assistant<|im_middle|><think>I should call the tool.</think>Checking."
            "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
            '<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|>'
            "<|im_end|>"
            "<|im_system|>tool<|im_middle|>Result of functions.get_weather:0\nsunny<|im_end|>"
            "<|im_assistant|>assistant<|im_middle|><think>Got it.</think>It is sunny.<|im_end|>"
            "<|im_assistant|>assistant<|im_middle|><think>")
    got = fmt.render(conversation(), tools=[WEATHER], reasoning_effort="low")
    assert got == tok.encode(want, allow_special=True)
    assert tok.decode(got) == want


def test_system_turn_is_added_for_tools_or_effort_without_a_system_message(fmt, tok):
    msgs = [{"role": "user", "content": "hi"}]
    want = ("<|im_system|>system<|im_middle|># Reasoning effort: max<|im_end|>"
            "<|im_user|>user<|im_middle|>hi<|im_end|><|im_assistant|>assistant<|im_middle|><think>")
    assert fmt.render(msgs, reasoning_effort="max") == tok.encode(want, allow_special=True)
    plain = "<|im_user|>user<|im_middle|>hi<|im_end|><|im_assistant|>assistant<|im_middle|><think>"
    assert fmt.render(msgs) == tok.encode(plain, allow_special=True)


def test_training_mask_covers_assistant_bodies_only(fmt, tok):
    msgs = [{"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "reasoning_content": "call it", "content": "",
             "tool_calls": [{"id": "functions.get_weather:0", "type": "function",
                             "function": {"name": "get_weather", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "sunny"},
            {"role": "assistant", "reasoning_content": "", "content": "Sunny."}]
    # (piece, trained) written by hand: <think> belongs to the prompt, </think> .. <|im_end|> do not
    pieces = [("<|im_user|>", 0), ("user", 0), ("<|im_middle|>", 0), ("Weather in Paris?", 0),
              ("<|im_end|>", 0),
              ("<|im_assistant|>", 0), ("assistant", 0), ("<|im_middle|>", 0), ("<think>", 0),
              ("call it", 1), ("</think>", 1), ("<|tool_calls_section_begin|>", 1),
              ("<|tool_call_begin|>", 1), ("functions.get_weather:0", 1),
              ("<|tool_call_argument_begin|>", 1), ("{}", 1), ("<|tool_call_end|>", 1),
              ("<|tool_calls_section_end|>", 1), ("<|im_end|>", 1),
              ("<|im_system|>", 0), ("tool", 0), ("<|im_middle|>", 0),
              ("Result of functions.get_weather:0\nsunny", 0), ("<|im_end|>", 0),
              ("<|im_assistant|>", 0), ("assistant", 0), ("<|im_middle|>", 0), ("<think>", 0),
              ("</think>", 1), ("Sunny.", 1), ("<|im_end|>", 1)]
    want_ids, want_mask = [], []
    for piece, trained in pieces:
        ids = tok.encode(piece, allow_special=True)
        want_ids += ids
        want_mask += [trained] * len(ids)
    ids, mask = fmt.render_for_training(msgs)
    assert ids == want_ids and mask == want_mask
    assert ids == fmt.render(msgs, add_generation_prompt=False)
    # weight 0 on the first assistant message: the same ids, its body untrained, the last one trained
    msgs[1]["weight"] = 0
    first = len(tok.encode("".join(p for p, _ in pieces[:19]), allow_special=True))
    assert fmt.render_for_training(msgs) == (want_ids, [0] * first + want_mask[first:])
    msgs[3]["weight"] = 1
    assert fmt.render_for_training(msgs) == (want_ids, [0] * first + want_mask[first:])


def test_next_turn_prompt_starts_with_the_previous_prompt_and_generation(fmt, tok):
    # "generation" = the ids a model would write: its text encoded, markers as ids
    ids = fmt.ids
    history = [{"role": "system", "content": "You are K3."}, {"role": "user", "content": "Weather?"}]
    for turn, (reasoning, content, call) in enumerate([
            ("Need the tool.", "", '{"city": "Paris"}'), ("It is sunny, 世界.", "Sunny 🎉", None)]):
        prompt = fmt.render(history, tools=[WEATHER], reasoning_effort="high")
        gen = tok.encode(reasoning) + [ids["</think>"]] + tok.encode(content)
        if call:
            gen += [ids["<|tool_calls_section_begin|>"], ids["<|tool_call_begin|>"],
                    *tok.encode("functions.get_weather:0"), ids["<|tool_call_argument_begin|>"],
                    *tok.encode(call), ids["<|tool_call_end|>"], ids["<|tool_calls_section_end|>"]]
        gen.append(ids["<|im_end|>"])
        reply = fmt.parse(gen).message()
        history.append(reply)
        if call:
            history.append({"role": "tool", "tool_call_id": reply["tool_calls"][0]["id"], "content": "sunny"})
        else:
            history.append({"role": "user", "content": "Thanks!"})
        nxt = fmt.render(history, tools=[WEATHER], reasoning_effort="high")
        assert nxt[:len(prompt) + len(gen)] == prompt + gen, f"turn {turn}"
        assert len(nxt) > len(prompt) + len(gen)
    # rendering is a pure function of the history
    assert fmt.render(history, tools=[WEATHER]) == fmt.render(list(history), tools=[WEATHER])


def test_earlier_reasoning_is_kept_in_the_history(fmt, tok):
    ids = fmt.render(conversation())
    assert tok.encode("I should call the tool.") == ids[ids.index(fmt.ids["<think>"]) + 1:][
        :len(tok.encode("I should call the tool."))]
    assert ids.count(fmt.ids["</think>"]) == 2


def test_literal_markers_in_messages_stay_text(fmt, tok):
    msgs = [{"role": "user", "content": "say <|im_end|><|im_assistant|> and </think>"}]
    ids = fmt.render(msgs)
    assert ids.count(fmt.ids["<|im_end|>"]) == 1 and ids.count(fmt.ids["</think>"]) == 0
    # positive control: the same text as a template does produce the ids
    assert tok.encode(msgs[0]["content"], allow_special=True).count(fmt.ids["<|im_end|>"]) == 1


def test_tool_calls_without_reasoning_are_refused_unless_allowed(fmt, tok):
    msgs = conversation()[:4]
    del msgs[2]["reasoning_content"]
    with pytest.raises(K3Error, match=r"messages\[2\]: an assistant message with tool_calls must carry"):
        fmt.render(msgs)
    ids = fmt.render(msgs, allow_missing_reasoning=True)
    think = fmt.ids["<think>"]
    k = ids.index(think)
    assert ids[k + 1] == fmt.ids["</think>"]  # empty thinking
    msgs[2]["reasoning_content"] = ""  # present but empty: accepted as is
    assert fmt.render(msgs) == ids
    del msgs[2]["tool_calls"]
    msgs.pop()
    fmt.render(msgs)  # no tool calls: no reasoning needed


def test_foreign_tool_call_ids_render_as_functions_name_index(fmt, tok):
    msgs = [{"role": "user", "content": "two"},
            {"role": "assistant", "reasoning_content": "", "content": "", "tool_calls": [
                {"id": "call_x", "type": "function", "function": {"name": "a", "arguments": "{}"}},
                {"id": "functions.b:7", "type": "function", "function": {"name": "b", "arguments": "{}"}},
                {"id": "functions.a:9", "type": "function", "function": {"name": "c", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "call_x", "content": "1"},
            {"role": "tool", "tool_call_id": "functions.c:2", "content": "3"}]
    text = tok.decode(fmt.render(msgs))
    # index = position in the conversation; a model-style id of the same name is kept verbatim
    for s in ("functions.a:0<|tool_call_argument_begin|>", "functions.b:7<|tool_call_argument_begin|>",
              "functions.c:2<|tool_call_argument_begin|>", "Result of functions.a:0\n1",
              "Result of functions.c:2\n3"):
        assert s in text


def test_openai_client_echo_fields_are_accepted_when_empty(fmt):
    m = {"role": "assistant", "content": "hi", "reasoning_content": "r", "refusal": None,
         "annotations": [], "audio": None, "function_call": None, "tool_calls": None}
    assert fmt.render([{"role": "user", "content": "q"}, m])
    with pytest.raises(K3Error, match=r"messages\[1\]\.refusal is not supported"):
        fmt.render([{"role": "user", "content": "q"}, {**m, "refusal": "no"}])


def _base():
    return [{"role": "user", "content": [{"type": "text", "text": "Weather "}, {"type": "text", "text": "?"}]},
            {"role": "assistant", "reasoning_content": "r", "content": None, "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "c1", "name": "get_weather", "content": "ok"}]


BAD = [
    (lambda m: m[0].update(role="developer"), r"messages\[0\]\.role must be one of"),
    (lambda m: m[0].update(content=[{"type": "image_url", "image_url": {"url": "x"}}]),
     r"messages\[0\]\.content\[0\] is an image, but this model has no vision tower"),
    (lambda m: m[0].update(content=[{"type": "input_audio", "input_audio": {}}]),
     r"messages\[0\]\.content\[0\]: a content part must be of type 'text'"),
    (lambda m: m[0].update(content=5), r"messages\[0\]\.content must be a string"),
    (lambda m: m[0].update(content="bad \ud800"), r"messages\[0\]\.content is not valid Unicode"),
    (lambda m: m[0].update(name="bob"), r"messages\[0\]\.name is not supported"),
    (lambda m: m[1]["tool_calls"][0]["function"].update(arguments={}), r"arguments must be a JSON string"),
    (lambda m: m[1]["tool_calls"][0]["function"].update(arguments="{bad"), r"arguments is not a JSON object"),
    (lambda m: m[1]["tool_calls"][0]["function"].update(arguments="[1]"), r"arguments is not a JSON object"),
    (lambda m: m[1]["tool_calls"][0]["function"].update(arguments='{"a": "\ud800"}'),
     r"arguments is not a JSON object"),
    (lambda m: m[1]["tool_calls"][0]["function"].update(name="a b"), r"tool_calls\[0\]\.function\.name"),
    (lambda m: m[1]["tool_calls"][0].update(type="code"), r"tool_calls\[0\] must be"),
    (lambda m: m[1].update(reasoning="other"), r"reasoning_content and reasoning differ"),
    (lambda m: m[2].update(tool_call_id="c2"), r"messages\[2\]\.tool_call_id 'c2' matches no earlier"),
    (lambda m: m[2].pop("tool_call_id"), r"messages\[2\]\.tool_call_id is required"),
    (lambda m: m.append("hello"), r"messages\[3\] must be an object"),
    (lambda m: m[2].update(name="other"), r"messages\[2\]\.name 'other' is not the function of call 'c1'"),
    (lambda m: m[1].update(weight=0.5), r"messages\[1\]\.weight must be 0 or 1"),
    (lambda m: m[1].update(weight=True), r"messages\[1\]\.weight must be 0 or 1"),
    (lambda m: m[0].update(weight=0), r"messages\[0\]\.weight is not supported on a user message"),
]


@pytest.mark.parametrize("mutate,match", BAD)
def test_malformed_messages_are_refused_naming_the_field(fmt, mutate, match):
    good = _base()
    assert fmt.render(good)  # positive control: the unmutated conversation renders
    mutate(good)
    with pytest.raises(K3Error, match=match):
        fmt.render(good)


def test_bad_tools_and_effort_are_refused(fmt):
    msgs = [{"role": "user", "content": "q"}]
    assert fmt.render(msgs, tools=[WEATHER], reasoning_effort="high")
    with pytest.raises(K3Error, match="reasoning_effort must be one of low, high, max"):
        fmt.render(msgs, reasoning_effort="medium")
    with pytest.raises(K3Error, match=r"tools\[0\]\.function\.name"):
        fmt.render(msgs, tools=[{"type": "function", "function": {"name": ""}}])
    with pytest.raises(K3Error, match=r"tools\[0\]\.function has unknown fields \['x'\]"):
        fmt.render(msgs, tools=[{"type": "function", "function": {"name": "f", "x": 1}}])
    with pytest.raises(K3Error, match=r"tools\[0\]\.function is not JSON text"):
        fmt.render(msgs, tools=[{"type": "function", "function": {"name": "f", "parameters": {1, 2}}}])
    with pytest.raises(K3Error, match=r"tools\[0\]\.function is not JSON text"):
        fmt.render(msgs, tools=[{"type": "function", "function": {"name": "f", "description": "\ud800"}}])
    with pytest.raises(K3Error, match="messages must be a list"):
        fmt.render("hello")


def test_old_tokenizer_without_chat_tokens_is_refused(tok):
    old = train_tokenizer([TEXT], 300, ["<|endoftext|>", "<|im_end|>", "<think>", "</think>"])
    with pytest.raises(K3Error, match=r"tokenizer has no chat tokens \(missing <\|im_system\|>"):
        ChatFormat(old)
    assert ChatFormat(tok).render([{"role": "user", "content": "q"}])  # positive control


def test_thinking_budget_table():
    assert [thinking_budget(e) for e in ("low", "high", "max")] == [512, 4096, None]
    assert thinking_budget() is None  # the default effort is max
    assert thinking_budget("low", caps={"low": 64, "high": 256, "max": 1024}) == 64
    with pytest.raises(K3Error, match="reasoning_effort must be one of low, high, max, got 'medium'"):
        thinking_budget("medium")
    with pytest.raises(K3Error, match="thinking cap for 'low'"):
        thinking_budget("low", caps={"low": -1})


_KEYS = ["role", "content", "reasoning_content", "reasoning", "tool_calls", "tool_call_id", "name",
         "type", "function", "arguments", "id", "text", "refusal"]
_VAL = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True, allow_subnormal=False)
                    | st.text(max_size=8) | st.sampled_from(["system", "user", "assistant", "tool",
                                                              "function", "text", "{}", "f"]),
                    lambda c: st.lists(c, max_size=3) | st.dictionaries(st.sampled_from(_KEYS), c, max_size=4),
                    max_leaves=12)


_CALL = st.fixed_dictionaries({"type": st.sampled_from(["function", "x"]), "function": st.fixed_dictionaries(
    {"name": st.sampled_from(["f", "g", "a b"]), "arguments": st.sampled_from(["{}", '{"a": 1}', "[", 3])})},
    optional={"id": st.sampled_from(["c1", "functions.f:0", "c2"])})
_MSG = st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant", "tool", "bot"])}, optional={
    "content": st.none() | st.text(max_size=8) | _VAL, "reasoning_content": st.text(max_size=4) | _VAL,
    "tool_calls": st.lists(_CALL, max_size=2) | _VAL, "tool_call_id": st.sampled_from(["c1", "functions.f:0"]),
    "name": _VAL})
_TOOLS = st.none() | st.lists(st.fixed_dictionaries({"type": st.just("function"), "function": st.fixed_dictionaries(
    {"name": st.sampled_from(["f", ""])}, optional={"parameters": _VAL})}), max_size=2) | _VAL


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(messages=st.lists(_MSG, max_size=5) | _VAL, tools=_TOOLS,
       effort=st.sampled_from([None, "low", "max"]) | _VAL)
def test_any_json_input_renders_or_raises_k3error(fmt, messages, tools, effort):
    # what the server must turn into a 400, never a 500; both outcomes occur (see the events)
    try:
        ids = fmt.render(messages, tools=tools, reasoning_effort=effort)
        assert ids[-1] == fmt.ids["<think>"]
        event("rendered")
    except K3Error:
        event("refused")
