"""The chat page at ``GET /`` driven in headless Chromium (Debian's ``chromium``) against a real
``k3 serve`` subprocess, over the Chrome DevTools Protocol (JSON messages on a websocket): the test types
a prompt, picks an effort, clicks Send, and watches the page stream the thinking and the answer. What the
page shows must equal the API's greedy reply to the same request, chunk by chunk; the thinking section
folds once the answer starts and opens again on a click. A screenshot is kept as a test artifact.

Chromium missing is a failure, not a skip: ``make test`` installs it."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from browser import START_S, Browser, chromium  # noqa: E402

REPLY_S = 180  # bound on the page finishing one streamed reply from the nano model on a shared CPU
PROMPT, EFFORT = "hello world", "low"

# Installed before Send: records every text the page puts into the thinking and answer boxes (each
# textContent write adds one text node), in order, the observer batch (page update) each answer text came in,
# and every change of the <details> open state.
OBSERVE = """
window.__seen = {thinking: [], answer: [], answerBatches: [], folds: [], batches: 0};
new MutationObserver(records => {
  window.__seen.batches += 1;
  for (const r of records) {
    if (r.type === "attributes") { window.__seen.folds.push([r.oldValue, r.target.open]); continue; }
    const box = r.target.className === "thinking-text" ? "thinking" : r.target.className;
    if (box !== "thinking" && box !== "answer") continue;
    for (const n of r.addedNodes) if (n.nodeType === Node.TEXT_NODE) {
      window.__seen[box].push(n.data); if (box === "answer") window.__seen.answerBatches.push(window.__seen.batches); }
  }
}).observe(document.getElementById("log"),
           {childList: true, subtree: true, attributes: true, attributeFilter: ["open"], attributeOldValue: true});
true
"""

SHOWN = """(() => {
  const turn = document.querySelector(".turn.assistant"), det = turn.querySelector("details.thinking");
  return {model: document.getElementById("model").textContent, user: document.querySelector(".turn.user").textContent,
          summary: det.querySelector("summary").textContent, open: det.open,
          thinking: turn.querySelector(".thinking-text").textContent, answer: turn.querySelector(".answer").textContent,
          errors: [...turn.querySelectorAll(".err")].map(e => e.textContent), seen: window.__seen};
})()"""


def _api_stream(url: str) -> tuple[list[str], list[str]]:
    """The API's streamed reply to the page's request: the running thinking and answer texts after
    each chunk that adds to them (what the page's two boxes should show, in order)."""
    body = {"model": "nano", "messages": [{"role": "user", "content": PROMPT}], "reasoning_effort": EFFORT,
            "temperature": 0, "stream": True}
    thinking, answer = [""], [""]
    with httpx.Client(timeout=REPLY_S) as c, c.stream("POST", url + "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            delta = json.loads(line[6:])["choices"][0]["delta"]
            assert not delta.get("tool_calls")  # this prompt's greedy reply is plain text
            for seen, key in ((thinking, "reasoning_content"), (answer, "content")):
                if delta.get(key):
                    seen.append(seen[-1] + delta[key])
    return thinking[1:], answer[1:]


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


@pytest.mark.slow
def test_chat_page_in_chromium_streams_thinking_and_answer(server, tmp_path):
    exe = chromium()
    browser = Browser(exe, tmp_path / "profile")
    try:
        browser.call("Page.navigate", url=server.url + "/")
        assert browser.wait_for('document.getElementById("model")?.textContent', START_S) == "nano"
        browser.type("#prompt", PROMPT)
        browser.type("#temp", "0")
        browser.eval(f'document.getElementById("effort").value = "{EFFORT}"')
        fields = browser.eval('["prompt", "temp", "effort"].map(i => document.getElementById(i).value)')
        assert fields == [PROMPT, "0", EFFORT]
        assert browser.eval(OBSERVE) is True
        browser.click("#send")
        browser.wait_for('document.querySelector(".turn.assistant")?.dataset.done === "1"', REPLY_S)
        shown = browser.eval(SHOWN)
        want_thinking, want_answer = _api_stream(server.url)
        assert shown["model"] == "nano" and shown["user"] == PROMPT and shown["errors"] == []
        assert shown["summary"] == "Thinking" and want_thinking and want_answer
        # streamed: every partial text the API sent appeared in the page, in order, ending at the whole reply
        assert shown["seen"]["thinking"] == want_thinking and shown["thinking"] == want_thinking[-1]
        assert shown["seen"]["answer"] == want_answer and shown["answer"] == want_answer[-1]
        assert len(set(shown["seen"]["answerBatches"])) > 1  # the answer grew over several page updates, not at once
        assert shown["seen"]["folds"] == [["", False]]  # open while thinking, folded once when the answer began
        assert shown["open"] is False
        browser.click("details.thinking summary")  # collapsible: a click opens it again, another folds it
        assert browser.wait_for('document.querySelector("details.thinking").open', 5) is True
        shot = browser.screenshot(tmp_path / "chat_page.png")
        browser.click("details.thinking summary")
        assert browser.wait_for('!document.querySelector("details.thinking").open', 5) is True
        viewport = browser.eval("[innerWidth, innerHeight].map(v => Math.round(v * devicePixelRatio))")
        assert list(_png_size(shot)) == viewport  # the page as the window shows it
        print(f"chat page screenshot: {shot} ({shown['seen']['batches']} DOM update batches, "
              f"{len(want_thinking)} thinking and {len(want_answer)} answer chunks)")
    finally:
        browser.close()


def test_missing_chromium_fails_with_the_install_hint(monkeypatch, tmp_path):
    assert Path(chromium()).name == "chromium"  # control: found on the normal PATH
    monkeypatch.setenv("PATH", str(tmp_path))  # a PATH with no chromium on it
    with pytest.raises(pytest.fail.Exception, match=r"run `make test`"):
        chromium()
