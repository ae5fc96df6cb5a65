"""Property test over real HTTP: any JSON body (built from the request fields with values of any JSON
type, messages of any shape) is answered 200 or 4xx with an error body, never 5xx; the server stays
healthy. The positive control: bodies that are valid by construction all succeed."""

from __future__ import annotations

import json

import httpx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

FIELDS = ["model", "messages", "max_tokens", "temperature", "top_p", "stream", "tools", "tool_choice",
          "reasoning_effort", "seed", "n", "stop", "prompt", "stream_options", "max_completion_tokens"]
scalar = st.one_of(st.none(), st.booleans(), st.integers(-10**20, 10**20),
                   st.floats(allow_nan=False, allow_subnormal=False),
                   st.text(max_size=20), st.sampled_from(["nano", "user", "assistant", "tool", "function", "low"]))
value = st.recursive(scalar, lambda kids: st.one_of(st.lists(kids, max_size=4),
                                                    st.dictionaries(st.sampled_from(
                                                        ["role", "content", "tool_calls", "function", "name",
                                                         "arguments", "type", "id", "reasoning_content",
                                                         "tool_call_id", "text"]), kids, max_size=4)),
                     max_leaves=12)
message = st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system", "tool", "x"])},
                                optional={"content": value, "tool_calls": value, "reasoning_content": value,
                                          "tool_call_id": value})
body = st.fixed_dictionaries({"model": st.sampled_from(["nano", "other"]), "max_tokens": st.just(1)},
                             optional={"messages": st.lists(message, max_size=3),
                                       **{f: value for f in FIELDS if f not in ("model", "max_tokens")}})
SETTINGS = settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck))


def _post(server, path, b):
    return httpx.post(server.url + path, content=json.dumps(b).encode(), timeout=60,
                      headers={"content-type": "application/json"})


@SETTINGS
@given(b=body, path=st.sampled_from(["/v1/chat/completions", "/v1/completions"]))
def test_any_body_is_never_a_5xx(server, b, path):
    b.pop("stream", None)  # whole replies: one status per request
    r = _post(server, path, b)
    ok = r.status_code == 200 or (400 <= r.status_code < 500 and isinstance(r.json()["error"]["message"], str))
    assert ok, (r.status_code, r.text[:300])


@settings(max_examples=15, deadline=None, suppress_health_check=list(HealthCheck))
@given(text=st.text(st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=30),
       effort=st.sampled_from(["low", "high", "max"]))
def test_valid_bodies_succeed(server, text, effort):
    r = _post(server, "/v1/chat/completions", {"model": "nano", "max_tokens": 1, "reasoning_effort": effort,
                                               "messages": [{"role": "user", "content": text}]})
    assert r.status_code == 200, r.text
    assert server.healthy()
