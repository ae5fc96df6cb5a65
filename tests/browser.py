"""Headless Chromium (Debian's ``chromium``) driven over the Chrome DevTools Protocol (JSON
messages on a websocket), for the tests of pages k3 serves or writes (the chat page, the eval
report). Chromium missing is a failure, not a skip: ``make test`` installs it."""

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


def chromium() -> str:
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
