"""A client that leaves mid-stream cancels its request at once (the engine's active count drops to 0
long before the request could have finished); /metrics in the Prometheus text format."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest

LONG = 1500  # tokens the abandoned request asks for: far more than it gets to generate


def _wait(pred, timeout: float, step: float = 0.05) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(step)
    return pred()


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_disconnect_mid_stream_cancels(server, path):
    body = {"model": "nano", "messages": [{"role": "user", "content": "hi"}], "max_tokens": LONG,
            "temperature": 0, "stream": True, "ignore_eos": True}
    if path == "/v1/completions":
        body = {**{k: v for k, v in body.items() if k != "messages"}, "prompt": "hello"}
    gen0 = server.metric("k3_generated_tokens_total")
    cancelled0 = server.metric("k3_cancelled_requests_total")
    with httpx.Client(timeout=60) as c:
        with c.stream("POST", server.url + path, json=body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            got = [next(lines) for _ in range(8)]  # a few chunks: the request is running
            assert sum(x.startswith("data: {") for x in got) >= 3
            assert server.metric("k3_active_sequences") == 1  # control: it was active while streaming
    assert _wait(lambda: server.metric("k3_active_sequences") == 0, 5.0)
    assert _wait(lambda: server.metric("k3_cancelled_requests_total") == cancelled0 + 1, 5.0)
    generated = server.metric("k3_generated_tokens_total") - gen0
    assert generated < LONG // 2  # it stopped early rather than running to max_tokens
    time.sleep(0.5)
    assert server.metric("k3_generated_tokens_total") - gen0 == generated  # and nothing more ran
    assert server.healthy()


def test_disconnect_while_waiting_for_a_whole_reply_cancels(server):
    """A non-streamed request whose client closes its socket while the reply is being generated.
    The socket is closed as soon as /metrics shows the request running, not after a fixed read
    timeout: on a fast machine a timeout could outlast the whole reply and nothing would be tested."""
    body = {"model": "nano", "prompt": "hello", "max_tokens": 2000, "temperature": 0, "ignore_eos": True}
    payload = json.dumps(body).encode()
    url = httpx.URL(server.url)
    gen0 = server.metric("k3_generated_tokens_total")
    cancelled0 = server.metric("k3_cancelled_requests_total")
    with socket.create_connection((url.host, url.port), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % (url.host.encode(), len(payload)) + payload)
        assert _wait(lambda: server.metric("k3_generated_tokens_total") > gen0, 10.0, step=0.01)  # it runs
        sock.setblocking(False)
        with pytest.raises(BlockingIOError):
            sock.recv(1)  # and has not answered yet
    assert _wait(lambda: server.metric("k3_active_sequences") == 0, 5.0)
    assert _wait(lambda: server.metric("k3_cancelled_requests_total") == cancelled0 + 1, 5.0)
    generated = server.metric("k3_generated_tokens_total") - gen0
    assert generated < body["max_tokens"]  # it stopped early rather than running to max_tokens
    time.sleep(0.5)
    assert server.metric("k3_generated_tokens_total") - gen0 == generated  # and nothing more ran
    r = httpx.post(server.url + "/v1/completions", json={**body, "max_tokens": 40}, timeout=60)  # control
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 40


def test_concurrent_streams_a_quarter_leaving(server):
    """16 streaming clients, 4 leaving after 2..8 lines: the 12 others all finish, each with the
    reply a lone request gets (greedy; batching changes nothing), and nothing stays active."""
    body = {"model": "nano", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 24,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    solo = httpx.post(server.url + "/v1/chat/completions", json={**body, "stream": False}, timeout=60).json()
    results, errors = [], []

    def client():
        try:
            with httpx.Client(timeout=60) as c, c.stream("POST", server.url + "/v1/chat/completions",
                                                         json=body) as r:
                results.append([x for x in r.iter_lines() if x])
        except Exception as e:  # noqa: BLE001 - collected and asserted empty below
            errors.append(e)

    def leaver(after: int):
        with httpx.Client(timeout=60) as c, c.stream("POST", server.url + "/v1/chat/completions",
                                                     json={**body, "max_tokens": LONG}) as r:
            it = r.iter_lines()
            for _ in range(after):
                next(it)

    threads = [threading.Thread(target=client) for _ in range(12)]
    threads += [threading.Thread(target=leaver, args=(a,)) for a in (2, 4, 6, 8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors and len(results) == 12
    want = solo["choices"][0]["message"]
    for lines in results:
        assert lines[-1] == "data: [DONE]"
        assert json.loads(lines[-2][6:])["usage"]["completion_tokens"] == solo["usage"]["completion_tokens"]
        deltas = [json.loads(x[6:])["choices"][0]["delta"] for x in lines[:-2]]
        assert "".join(d.get("reasoning_content") or "" for d in deltas) == want["reasoning_content"]
        assert "".join(d.get("content") or "" for d in deltas) == want["content"]
    assert _wait(lambda: server.metric("k3_active_sequences") == 0 and server.metric("k3_queue_depth") == 0, 5)


def test_metrics_text(server):
    httpx.post(server.url + "/v1/completions", json={"model": "nano", "prompt": "hello", "max_tokens": 3},
               timeout=60).raise_for_status()
    text = httpx.get(server.url + "/metrics", timeout=10).text
    assert text.endswith("\n")
    samples = {}
    for line in text.splitlines():
        if not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)  # every sample line is NAME VALUE with a number
    assert samples['k3_http_requests_total{path="/v1/completions",status="200"}'] >= 1
    for name in ("k3_active_sequences", "k3_queue_depth", "k3_prefix_cache_hit_rate",
                 "k3_time_to_first_token_seconds_sum", "k3_output_tokens_per_second", "k3_generated_tokens_total"):
        assert name in samples
    assert samples["k3_time_to_first_token_seconds_count"] >= 1 and samples["k3_output_tokens_per_second"] > 0
    assert 0 <= samples["k3_prefix_cache_hit_rate"] <= 1


def test_second_turn_hits_the_prefix_cache(server):
    """Preserved thinking: turn 2's prompt starts with turn 1's, so the prefix cache hits."""
    msgs = [{"role": "user", "content": "the quick brown fox jumps over the lazy dog " * 8}]
    r = httpx.post(server.url + "/v1/chat/completions", timeout=60,
                   json={"model": "nano", "messages": msgs, "max_tokens": 4, "temperature": 0}).json()
    hits0 = server.metric("k3_prefix_cache_hits_total")
    msg = r["choices"][0]["message"]
    msgs2 = [*msgs, {"role": "assistant", "content": msg["content"], "reasoning_content": msg["reasoning_content"]},
             {"role": "user", "content": "and?"}]
    httpx.post(server.url + "/v1/chat/completions", timeout=60,
               json={"model": "nano", "messages": msgs2, "max_tokens": 2}).raise_for_status()
    assert server.metric("k3_prefix_cache_hits_total") == hits0 + 1


def test_chat_page_is_self_contained(server):
    r = httpx.get(server.url + "/", timeout=10)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    html = r.text
    assert "http://" not in html and "https://" not in html and "<link" not in html  # nothing fetched elsewhere
    assert "<script src" not in html and "@import" not in html
    assert all(f"<option{' selected' if e == 'max' else ''}>{e}</option>" in html for e in ("low", "high", "max"))
    assert '"/v1/chat/completions"' in html and "reasoning_content" in html and '"details"' in html


@pytest.mark.skipif(shutil.which("node") is None, reason="node is not installed (the page's script runs in node)")
def test_chat_page_script_streams_thinking_and_answer(server):
    """The page's own JavaScript, run by node against a minimal DOM (no browser here), sends the
    prompt and shows the streamed thinking and answer: equal to the API's reply to the same request."""
    driver = Path(__file__).with_name("page_driver.js")
    r = subprocess.run(["node", str(driver), server.url, "hello world", "low", "0"], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    shown = json.loads(r.stdout)
    want = httpx.post(server.url + "/v1/chat/completions", timeout=120, json={
        "model": "nano", "messages": [{"role": "user", "content": "hello world"}], "reasoning_effort": "low",
        "temperature": 0}).json()["choices"][0]["message"]
    assert shown["model"] == "nano" and shown["errors"] == [] and shown["done"] == "1"
    assert shown["thinking"] == want["reasoning_content"] != ""
    assert "tool_calls" in want or shown["answer"] == want["content"]
    assert shown["collapsed"] == bool(want["content"])  # the thinking folds once the answer starts
