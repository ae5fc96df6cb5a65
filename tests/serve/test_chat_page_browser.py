"""The chat page at ``GET /`` driven in headless Chromium (Debian's ``chromium``) against a real
``k3 serve`` subprocess, over the Chrome DevTools Protocol (JSON messages on a websocket): the test types
a prompt, picks an effort, clicks Send, and watches the page stream the thinking and the answer. What the
page shows must equal the API's greedy reply to the same request, chunk by chunk; the thinking section
folds once the answer starts and opens again on a click. A screenshot is kept as a test artifact.

Chromium missing is a failure, not a skip: ``make test`` installs it."""

from __future__ import annotations

import base64
import json
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import pytest
import websocket

from k3.serve.launch import stop_process

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--window-size=1000,800", "--remote-debugging-port=0"]
START_S = 60  # bound on chromium coming up and on each DevTools reply
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


def _chromium() -> str:
    exe = shutil.which("chromium")
    if exe is None:
        pytest.fail("chromium is not installed: run `make test` (it installs Debian's chromium package)")
    return exe


class Browser:
    """One headless Chromium process with a fresh profile, and a DevTools session on its page."""

    def __init__(self, exe: str, profile: Path):
        self.log = (profile.parent / "chromium.log").open("w")
        self.proc = subprocess.Popen([exe, *FLAGS, f"--user-data-dir={profile}", "about:blank"],
                                     stdout=self.log, stderr=subprocess.STDOUT)
        self.ws = None
        self.last_id = 0
        port = self._devtools_port(profile / "DevToolsActivePort")
        targets = httpx.get(f"http://127.0.0.1:{port}/json/list", timeout=START_S).json()
        page = next(t for t in targets if t["type"] == "page")
        self.ws = websocket.create_connection(page["webSocketDebuggerUrl"], timeout=START_S, suppress_origin=True)

    def _devtools_port(self, path: Path) -> int:
        """Chromium writes the port it bound (first line) once its DevTools server listens."""
        end = time.monotonic() + START_S
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"chromium exited with {self.proc.returncode}; see {self.log.name}")
            lines = path.read_text().splitlines() if path.exists() else []
            if len(lines) >= 2:
                return int(lines[0])
            time.sleep(0.1)
        raise TimeoutError(f"chromium wrote no {path} in {START_S}s")

    def call(self, method: str, **params):
        """Send one DevTools command; return its result (events that arrive meanwhile are dropped)."""
        self.last_id += 1
        self.ws.send(json.dumps({"id": self.last_id, "method": method, "params": params}))
        while True:
            msg = json.loads(self.ws.recv())  # bounded: the socket times out after START_S
            if msg.get("id") == self.last_id:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg["result"]

    def eval(self, expr: str):
        r = self.call("Runtime.evaluate", expression=expr, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in r:
            raise RuntimeError(f"page script failed: {r['exceptionDetails']}")
        return r["result"].get("value")

    def wait_for(self, expr: str, timeout: float):
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            value = self.eval(expr)
            if value:
                return value
            time.sleep(0.05)
        raise TimeoutError(f"not true after {timeout}s: {expr}")

    def click(self, selector: str) -> None:
        """A real mouse click (press + release) at the centre of the element."""
        x, y = self.eval(f"(() => {{ const r = document.querySelector({json.dumps(selector)})"
                         ".getBoundingClientRect(); return [r.x + r.width / 2, r.y + r.height / 2]; })()")
        for kind in ("mousePressed", "mouseReleased"):
            self.call("Input.dispatchMouseEvent", type=kind, x=x, y=y, button="left", clickCount=1)

    def type(self, selector: str, text: str) -> None:
        """Focus the field, select what is in it, and type ``text`` over it as keyboard input."""
        self.eval(f"(() => {{ const e = document.querySelector({json.dumps(selector)}); e.focus(); e.select();"
                  " return true; })()")
        self.call("Input.insertText", text=text)

    def screenshot(self, path: Path) -> Path:
        path.write_bytes(base64.b64decode(self.call("Page.captureScreenshot", format="png")["data"]))
        return path

    def close(self) -> None:
        if self.ws is not None:
            self.ws.close()
        stop_process(self.proc)
        self.log.close()


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
    exe = _chromium()
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
    assert Path(_chromium()).name == "chromium"  # control: found on the normal PATH
    monkeypatch.setenv("PATH", str(tmp_path))  # a PATH with no chromium on it
    with pytest.raises(pytest.fail.Exception, match=r"run `make test`"):
        _chromium()
