"""The chat page at ``GET /`` driven in headless Chromium (Debian's ``chromium``) against a real
``k3 serve`` subprocess, over the Chrome DevTools Protocol (JSON messages on a websocket): the test types
a prompt, picks an effort, clicks Send, and watches the page stream the thinking and the answer. What the
page shows must equal the API's greedy reply to the same request, chunk by chunk; the thinking section
folds once the answer starts and opens again on a click. A screenshot is kept as a test artifact.

Images: files set on the page's ``#image`` input (DevTools ``DOM.setFileInputFiles``, real files on
disk) go with the message as ``image_url`` content parts; a vision checkpoint answers them, a text-only one
answers 400 and the page shows its message.

Chromium missing is a failure, not a skip: ``make test`` installs it."""

from __future__ import annotations

import base64
import json
import sys
from pathlib import Path

import httpx
import pytest
from PIL import Image

from k3.serve.launch import launch

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


def _api_stream(url: str, body: dict | None = None) -> tuple[list[str], list[str]]:
    """The API's streamed reply to the page's request (``body``, by default the first test's): the running
    thinking and answer texts after each chunk that adds to them (what the page's two boxes should show, in order)."""
    if body is None:
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


# --- images ---------------------------------------------------------------------------------------------

VL_TEXT = "what colour is this image? red green blue. the answer is red. "
IMAGE_PROMPT = "what colour?"

# Installed before Send: wraps window.fetch to keep the parsed JSON body of every chat request the page sends.
RECORD = """
window.__sent = [];
const realFetch = window.fetch;
window.fetch = (url, opts) => {
  if (String(url).endsWith("/v1/chat/completions") && opts && opts.body) window.__sent.push(JSON.parse(opts.body));
  return realFetch(url, opts);
};
true
"""

TURNS = """[...document.querySelectorAll("#log .turn")].map(t => ({
  cls: t.className, text: t.querySelector(".answer") ? t.querySelector(".answer").textContent : t.textContent,
  thinking: t.querySelector(".thinking-text")?.textContent ?? null, done: t.dataset.done ?? null,
  errors: [...t.querySelectorAll(".err")].map(e => e.textContent),
  imgs: [...t.querySelectorAll("img")].map(i => ({src: i.src, alt: i.alt, w: i.naturalWidth, h: i.naturalHeight,
                                                  maxH: getComputedStyle(i).maxHeight}))}))"""


def _done(n: int) -> str:
    """True once the page's ``n``-th assistant turn (0-based) has finished (reply or error)."""
    return f'document.querySelectorAll(".turn.assistant")[{n}]?.dataset.done === "1"'


def _png(path: Path, size, colour) -> Path:
    Image.new("RGB", size, colour).save(path, "PNG")
    return path


def _data_url(path: Path) -> str:
    return "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode()


def _attach(browser: Browser, *paths: Path) -> None:
    """Choose files on the page's #image input the way a file dialog would (DevTools, files on disk)."""
    obj = browser.call("Runtime.evaluate", expression='document.getElementById("image")')["result"]["objectId"]
    browser.call("DOM.setFileInputFiles", files=[str(p) for p in paths], objectId=obj)
    assert browser.eval('[...document.getElementById("image").files].map(f => f.name)') == [p.name for p in paths]


def _open(browser: Browser, url: str) -> str:
    """Load the chat page, wait for its model name, set effort low and temperature 0, record its requests."""
    browser.call("Page.navigate", url=url + "/")
    model = browser.wait_for('document.getElementById("model")?.textContent', START_S)
    browser.type("#temp", "0")
    browser.eval(f'document.getElementById("effort").value = "{EFFORT}"')
    assert browser.eval(RECORD) is True
    return model


def _send(browser: Browser, text: str, n: int) -> None:
    """Type ``text``, click Send, wait for the ``n``-th assistant turn to finish."""
    if text:
        browser.type("#prompt", text)
    browser.click("#send")
    browser.wait_for(_done(n), REPLY_S)


@pytest.fixture(scope="module")
def vl_server(tmp_path_factory, make_nano_vl_checkpoint):
    d, _, _ = make_nano_vl_checkpoint(tmp_path_factory.mktemp("page-vl") / "nano-vl", VL_TEXT)
    with launch(d, "--thinking-cap-low", "3", threads=1) as s:
        yield s


@pytest.mark.slow
def test_chat_page_sends_attached_images_to_a_vision_model(vl_server, tmp_path):
    red, blue = _png(tmp_path / "red.png", (40, 30), (200, 20, 20)), _png(tmp_path / "blue.png", (30, 50), (20, 20, 200))
    browser = Browser(chromium(), tmp_path / "profile")
    try:
        model = _open(browser, vl_server.url)
        _attach(browser, red, blue)
        _send(browser, IMAGE_PROMPT, 0)
        sent = browser.eval("window.__sent")
        turns = browser.eval(TURNS)
        assert browser.eval('document.getElementById("image").files.length') == 0  # the input was cleared
        # the request: one image_url part per file, in order, each the file's bytes as a data: URL, then the text
        want_parts = [{"type": "image_url", "image_url": {"url": _data_url(red)}},
                      {"type": "image_url", "image_url": {"url": _data_url(blue)}},
                      {"type": "text", "text": IMAGE_PROMPT}]
        assert len(sent) == 1 and sent[0]["messages"] == [{"role": "user", "content": want_parts}]
        assert sent[0]["model"] == model and sent[0]["reasoning_effort"] == EFFORT and sent[0]["temperature"] == 0
        # the log: the user's turn shows both images as decoded thumbnails (max 8rem high) and the text
        user, reply = turns
        assert user["cls"] == "turn user" and user["text"] == IMAGE_PROMPT and user["errors"] == []
        assert [(i["src"], i["alt"], i["w"], i["h"]) for i in user["imgs"]] == [
            (_data_url(red), "red.png", 40, 30), (_data_url(blue), "blue.png", 30, 50)]
        assert {i["maxH"] for i in user["imgs"]} == {"128px"}
        # the reply: no error, and what the page shows is the API's greedy reply to the same request
        assert reply["cls"] == "turn assistant" and reply["errors"] == [] and reply["imgs"] == []
        want_thinking, want_answer = _api_stream(vl_server.url, sent[0])
        assert want_thinking or want_answer
        assert reply["thinking"] == (want_thinking or [""])[-1] and reply["text"] == (want_answer or [""])[-1]
        # a later text-only turn sends the history with the image parts again, and its own text as a plain string
        _send(browser, "and now?", 1)
        sent = browser.eval("window.__sent")
        turns = browser.eval(TURNS)
        assert len(sent) == 2 and len(turns) == 4 and turns[3]["errors"] == []
        msgs = sent[1]["messages"]
        assert msgs[0] == {"role": "user", "content": want_parts}
        assert msgs[1]["role"] == "assistant" and msgs[1]["content"] == reply["text"]
        assert msgs[2] == {"role": "user", "content": "and now?"} and len(msgs) == 3
        assert turns[2] == {**turns[2], "cls": "turn user", "text": "and now?", "imgs": []}
        print(f"chat page screenshot: {browser.screenshot(tmp_path / 'chat_page_images.png')}")
    finally:
        browser.close()


@pytest.mark.slow
def test_chat_page_shows_a_text_only_models_refusal_of_an_image(server, tmp_path):
    red = _png(tmp_path / "red.png", (40, 30), (200, 20, 20))
    browser = Browser(chromium(), tmp_path / "profile")
    try:
        assert _open(browser, server.url) == "nano"
        _attach(browser, red)
        _send(browser, IMAGE_PROMPT, 0)
        turns = browser.eval(TURNS)
        sent = browser.eval("window.__sent")
        assert sent[0]["messages"][0]["content"][0]["type"] == "image_url"  # the image was sent
        assert len(turns) == 2 and turns[0]["cls"] == "turn user" and len(turns[0]["imgs"]) == 1
        [err] = turns[1]["errors"]  # the server's 400 message, shown the way the page shows errors
        assert err.startswith("error: ") and "has no vision tower" in err and "messages[0].content[0]" in err
        # positive control: a text-only message to the same server and page gets a reply; the refused
        # image turn is not in the history it sends
        _send(browser, PROMPT, 1)
        turns = browser.eval(TURNS)
        sent = browser.eval("window.__sent")
        assert sent[1]["messages"] == [{"role": "user", "content": PROMPT}]
        assert turns[2]["cls"] == "turn user" and turns[2]["text"] == PROMPT and turns[2]["imgs"] == []
        assert turns[3]["errors"] == [] and turns[3]["done"] == "1" and (turns[3]["text"] or turns[3]["thinking"])
    finally:
        browser.close()
