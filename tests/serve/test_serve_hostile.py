"""Malformed and hostile requests over raw HTTP: each gets a 4xx with an OpenAI-style error body,
the same request made valid succeeds (the positive control), and /health stays ok afterwards."""

from __future__ import annotations

import json

import httpx
import pytest

CHAT, COMP = "/v1/chat/completions", "/v1/completions"
GOOD = {"model": "nano", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def with_(**kw):
    return json.dumps({**GOOD, **kw}).encode()


# (name, path, bad body bytes, good body bytes, expected status)
CASES = [
    ("bad json", CHAT, b'{"model": "nano", "messages": [', with_(), 400),
    ("not an object", CHAT, b"[1, 2]", with_(), 400),
    ("invalid utf-8", COMP, b'{"model": "nano", "max_tokens": 2, "prompt": "\xff\xfe"}',
     b'{"model": "nano", "max_tokens": 2, "prompt": "ok"}', 400),
    ("wrong type max_tokens", CHAT, with_(max_tokens="two"), with_(max_tokens=2), 400),
    ("bool as int", CHAT, with_(max_tokens=True), with_(max_tokens=1), 400),
    ("wrong type messages", CHAT, with_(messages="hi"), with_(), 400),
    ("content not text", CHAT, with_(messages=[{"role": "user", "content": 5}]), with_(), 400),
    ("unknown role", CHAT, with_(messages=[{"role": "wizard", "content": "hi"}]), with_(), 400),
    ("empty messages", CHAT, with_(messages=[]), with_(), 400),
    ("unknown model", CHAT, with_(model="gpt-9"), with_(model="nano"), 404),
    ("huge max_tokens", CHAT, with_(max_tokens=10**12), with_(max_tokens=3), 400),
    ("max_tokens past context", COMP, b'{"model": "nano", "prompt": "hi", "max_tokens": 2048}',
     b'{"model": "nano", "prompt": "hi", "max_tokens": 4}', 400),
    ("negative temperature", CHAT, with_(temperature=-1), with_(temperature=0), 400),
    ("n > 1", CHAT, with_(n=2), with_(n=1), 400),
    ("unknown field", CHAT, with_(frobnicate=1), with_(), 400),
    ("bad effort", CHAT, with_(reasoning_effort="extreme"), with_(reasoning_effort="high"), 400),
    ("bad tool", CHAT, with_(tools=[{"type": "function", "function": {"name": "a b"}}]),
     with_(tools=[{"type": "function", "function": {"name": "ab"}}]), 400),
    ("lone surrogate", CHAT, with_(messages=[{"role": "user", "content": "\ud800"}]), with_(), 400),
    ("lone surrogate prompt", COMP, b'{"model": "nano", "max_tokens": 2, "prompt": "a\\ud800"}',
     b'{"model": "nano", "max_tokens": 2, "prompt": "a"}', 400),
    ("surrogate bytes prompt", COMP, b'{"model": "nano", "max_tokens": 2, "prompt": "a\xed\xa0\x80"}',
     b'{"model": "nano", "max_tokens": 2, "prompt": "a"}', 400),
    ("lone surrogate stop", COMP, b'{"model": "nano", "max_tokens": 2, "prompt": "a", "stop": "\\udfff"}',
     b'{"model": "nano", "max_tokens": 2, "prompt": "a", "stop": "z"}', 400),
    ("token id outside vocab", COMP, b'{"model": "nano", "prompt": [1, 99999], "max_tokens": 2}',
     b'{"model": "nano", "prompt": [1, 9], "max_tokens": 2}', 400),
    ("10 MB body", CHAT, with_(messages=[{"role": "user", "content": "x" * (10 << 20)}]), with_(), 413),
]


@pytest.mark.parametrize("name,path,bad,good,status", CASES, ids=[c[0] for c in CASES])
def test_refused_with_error_body_then_healthy(server, name, path, bad, good, status):
    headers = {"content-type": "application/json"}
    r = httpx.post(server.url + path, content=bad, headers=headers, timeout=60)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert isinstance(err["message"], str) and err["message"] and "type" in err
    assert server.healthy()
    ok = httpx.post(server.url + path, content=good, headers=headers, timeout=60)
    assert ok.status_code == 200, ok.text
    assert ok.json()["usage"]["completion_tokens"] >= 1


def test_unknown_route_and_method_are_4xx(server):
    assert httpx.get(server.url + "/v1/models", timeout=10).status_code == 200
    r = httpx.get(server.url + "/v1/nothing", timeout=10)
    assert r.status_code == 404 and "error" in r.json()
    r = httpx.get(server.url + CHAT, timeout=10)
    assert r.status_code == 405 and "error" in r.json()


def test_api_key(keyed_server):
    url = keyed_server.url
    for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": "sekrit"}):
        r = httpx.post(url + CHAT, content=with_(), headers=headers, timeout=60)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        assert httpx.get(url + "/v1/models", headers=headers, timeout=10).status_code == 401
    good = {"authorization": "Bearer sekrit"}
    assert httpx.post(url + CHAT, content=with_(), headers=good, timeout=60).status_code == 200
    assert httpx.get(url + "/v1/models", headers=good, timeout=10).status_code == 200
    assert keyed_server.healthy()


def test_no_5xx_was_ever_answered(server):
    """Runs after the cases above (file order): the server's own status counters show no 5xx."""
    text = httpx.get(server.url + "/metrics", timeout=10).text
    statuses = [line.split('status="')[1][0] for line in text.splitlines()
                if line.startswith("k3_http_requests_total")]
    assert "4" in statuses and "2" in statuses and "5" not in statuses


@pytest.mark.parametrize("flags,msg", [
    (["--port", "70000"], "--port must be in [0, 65535]"),
    (["--max-body-mb", "0"], "--max-body-mb must be > 0"),
    (["--thinking-cap-low", "-1"], "--thinking-cap-low must be >= 0"),
])
def test_serve_flag_errors_are_one_line_exit_2(ckpt, flags, msg):
    import os
    import subprocess
    import sys

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-m", "k3.cli", "serve", str(ckpt[0]), *flags], capture_output=True,
                       text=True, env=env, timeout=120)
    assert r.returncode == 2 and msg in r.stderr and "Traceback" not in r.stderr, r.stderr
    missing = subprocess.run([sys.executable, "-m", "k3.cli", "serve", str(ckpt[0]) + "_nope"], capture_output=True,
                             text=True, env=env, timeout=120)
    assert missing.returncode == 2 and "no such file or directory" in missing.stderr
