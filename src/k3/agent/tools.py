"""The agent's tools over a ``Sandbox`` (SPEC §7.3): shell, read, write, edit, list, submit, screenshot.

``k3.tasks.tool_specs.TOOL_SPECS`` is the canonical schema (names and arguments as task transcripts
write them); ``tool_schemas(cfg, allowed)`` renders it as OpenAI ``tools`` under a harness config's renaming.
``ToolBox(sandbox).run(name, args, timeout_cap)`` executes one canonical call and returns a
``ToolResult``; bad arguments and failed operations are results with ``error=True`` (the model
sees why), never exceptions. Paths are relative to the sandbox workdir (``/workspace``). Output
shown to the model is capped at ``max_output`` characters per call (head and tail kept, the cut
stated). ``submit`` is not run here: the harness collects the submission (``k3.tasks.verify``).

``screenshot {path, width?, height?}`` renders a file of the workdir (a page, an SVG, an image) with
the headless Chromium of the sandbox's image (the ``browser`` image, k3.env.images) inside the
sandbox, with no network, at width x height (default 640x480, each within 64..1600), and returns
the PNG as an image of the result (``ToolResult.images``, a data URL) after a one-line text. A path
outside the workdir (also through a symlink), a missing file, a sandbox without Chromium and a
render that fails or runs past its time are error results naming the problem.
"""

from __future__ import annotations

import base64
import posixpath
import secrets
import shlex
import struct
import urllib.parse

from k3.agent.randomize import HarnessConfig
from k3.agent.turns import ToolResult
from k3.env.sandbox import Sandbox, SandboxError
from k3.tasks.tool_specs import TOOL_SPECS, check_arguments

__all__ = ["ToolBox", "tool_schemas", "AGENT_ENV", "SCREENSHOT_SIZE", "SCREENSHOT_BOUNDS", "CHROMIUM_FLAGS"]

AGENT_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/root", "LANG": "C.UTF-8"}
DEFAULT_SHELL_TIMEOUT = 60.0
SCREENSHOT_SIZE = (640, 480)
SCREENSHOT_BOUNDS = (64, 1600)
SCREENSHOT_TIMEOUT = 60.0
SCREENSHOT_MAX_BYTES = 8 << 20
SCREENSHOT_EXTS = (".html", ".htm", ".xhtml", ".svg", ".png", ".jpg", ".jpeg", ".gif", ".webp", ".bmp", ".txt")
CHROMIUM = "/usr/bin/chromium"   # in the browser image: the binary itself (k3.env.images)
CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
                  "--disable-extensions", "--disable-background-networking", "--mute-audio", "--hide-scrollbars",
                  "--force-device-scale-factor=1", "--force-color-profile=srgb", "--disable-crash-reporter",
                  "--host-resolver-rules=MAP * ~NOTFOUND")
# Run inside the sandbox as ``sh -c SCRIPT sh FILE OUT W,H URL``: resolve FILE (symlinks too), refuse
# what is not a regular file under the workdir, render URL (FILE's) with a fresh profile, remove it.
# ``timeout`` kills the browser's whole process group in time, so that no renderer outlives a call.
_SHOT = """
p=$(realpath -e -- "$1" 2>/dev/null) || exit 81
case "$p" in {workdir}/*) ;; *) exit 82 ;; esac
[ -f "$p" ] || exit 83
[ -x {chromium} ] || exit 84
ud=$(mktemp -d /tmp/k3-chromium-XXXXXX) || exit 85
TMPDIR="$ud" timeout -k 2 {seconds} {chromium} {flags} --user-data-dir="$ud" \\
    --screenshot="$2" --window-size="$3" "$4" </dev/null
rc=$?
rm -rf "$ud"
case $rc in 124|137) exit 86 ;; esac
exit $rc
"""
_SHOT_ERRORS = {81: "no such file", 82: "the path leads outside the working directory", 83: "not a regular file",
                84: "this sandbox has no headless browser (a task needs image = \"browser\" for screenshot)",
                85: "could not make a browser profile in /tmp"}  # 86: the browser ran out of time


def tool_schemas(cfg: HarnessConfig, allowed: list[str] | tuple[str, ...]) -> list[dict]:
    """OpenAI ``tools`` entries for the allowed tools, renamed by ``cfg``."""
    out = []
    for name in allowed:
        desc, args = TOOL_SPECS[name]
        props = {cfg.arg_names[a]: {"type": t, "description": d} for a, (t, _, d) in args.items()}
        req = [cfg.arg_names[a] for a, (_, r, _) in args.items() if r]
        out.append({"type": "function", "function": {
            "name": cfg.tool_names[name], "description": desc,
            "parameters": {"type": "object", "properties": props, "required": req,
                           "additionalProperties": False}}})
    return out


def _cap(text: str, limit: int) -> tuple[str, bool]:
    if len(text) <= limit:
        return text, False
    half = limit // 2
    return f"{text[:half]}\n[... {len(text) - limit} characters cut ...]\n{text[-half:]}", True


class ToolBox:
    def __init__(self, sandbox: Sandbox, max_output: int = 8000, env: dict[str, str] | None = None):
        self.sb, self.max_output = sandbox, max_output
        self.env = dict(AGENT_ENV if env is None else env)
        self.workdir = sandbox.workdir

    def run(self, name: str, args: dict, timeout_cap: float | None = None) -> ToolResult:
        problem = check_arguments(name, args)
        if problem is not None:
            return ToolResult("", name, f"error: {problem}", error=True, meta={"bad_arguments": True})
        try:
            return getattr(self, "_" + name)(args, timeout_cap)
        except SandboxError as e:
            return ToolResult("", name, f"error: {e}", error=True, meta={"sandbox_error": True})

    def _shell(self, args, cap) -> ToolResult:
        timeout = float(args.get("timeout", DEFAULT_SHELL_TIMEOUT))
        timeout = max(0.1, min(timeout, DEFAULT_SHELL_TIMEOUT * 10))
        if cap is not None:
            timeout = max(0.01, min(timeout, cap))
        r = self.sb.exec(args["command"], timeout=timeout, env=self.env, cwd=self.workdir)
        out = r.stdout.decode("utf-8", "replace")
        err = r.stderr.decode("utf-8", "replace")
        status = "timed out" if r.timed_out else f"exit code {r.exit_code}"
        text = f"{status}\n{out}" + (f"\n[stderr]\n{err}" if err else "")
        text, cut = _cap(text, self.max_output)
        return ToolResult("", "shell", text, error=not r.ok,
                          meta={"exit_code": r.exit_code, "timed_out": r.timed_out, "timeout": timeout,
                                "truncated": cut or r.truncated})

    def _read(self, args, cap) -> ToolResult:
        data = self.sb.read_file(args["path"], max_bytes=4 * self.max_output)
        text, cut = _cap(data.decode("utf-8", "replace"), self.max_output)
        return ToolResult("", "read", text, meta={"bytes": len(data), "truncated": cut})

    def _write(self, args, cap) -> ToolResult:
        self._write_file(args["path"], args["content"])
        return ToolResult("", "write", f"wrote {len(args['content'].encode())} bytes to {args['path']}")

    def write_text(self, path: str, content: str) -> None:
        """Write ``content`` to ``path`` (relative to the workdir), making parent directories;
        raises SandboxError. What ``write`` does, for the harness's own writes."""
        self._write_file(path, content)

    def _write_file(self, path: str, content: str) -> None:
        try:
            self.sb.write_file(path, content)
        except SandboxError:
            parent = posixpath.dirname(path)
            if not parent:
                raise
            r = self.sb.exec(["mkdir", "-p", "--", parent], timeout=30, env=self.env, cwd=self.workdir)
            if not r.ok:
                raise
            self.sb.write_file(path, content)

    def _edit(self, args, cap) -> ToolResult:
        text = self.sb.read_file(args["path"]).decode("utf-8", "replace")
        n = text.count(args["old"]) if args["old"] else 0
        if n != 1:
            return ToolResult("", "edit", f"error: the text to replace occurs {n} times in {args['path']} "
                                          "(it must occur exactly once)", error=True, meta={"occurrences": n})
        self.sb.write_file(args["path"], text.replace(args["old"], args["new"], 1))
        return ToolResult("", "edit", f"edited {args['path']}")

    def _list(self, args, cap) -> ToolResult:
        entries = sorted(self.sb.list(args.get("path", ".")), key=lambda e: e.path)
        lines = [f"{e.path}/" if e.kind == "dir" else f"{e.path} -> (link)" if e.kind == "symlink"
                 else f"{e.path} ({e.size} bytes)" for e in entries]
        text, cut = _cap("\n".join(lines) or "(empty)", self.max_output)
        return ToolResult("", "list", text, meta={"entries": len(entries), "truncated": cut})

    def _screenshot(self, args, cap) -> ToolResult:
        path = args["path"]
        width, height = args.get("width", SCREENSHOT_SIZE[0]), args.get("height", SCREENSHOT_SIZE[1])
        lo, hi = SCREENSHOT_BOUNDS
        for k, v in (("width", width), ("height", height)):
            if not lo <= v <= hi:
                return ToolResult("", "screenshot", f"error: screenshot: {k} {v} is out of range ({lo} to {hi})",
                                  error=True, meta={"bad_arguments": True})
        full = posixpath.normpath(posixpath.join(self.workdir, path))
        if not full.startswith(self.workdir.rstrip("/") + "/"):
            return ToolResult("", "screenshot", f"error: {path}: outside the working directory {self.workdir}",
                              error=True, meta={"outside": True})
        if not full.lower().endswith(SCREENSHOT_EXTS):
            return ToolResult("", "screenshot", f"error: {path}: not a page or image file (one of "
                                                f"{' '.join(SCREENSHOT_EXTS)})", error=True,
                              meta={"bad_arguments": True})
        timeout = SCREENSHOT_TIMEOUT if cap is None else max(0.01, min(SCREENSHOT_TIMEOUT, cap))
        out = f"/tmp/k3-screenshot-{secrets.token_hex(8)}.png"
        script = _SHOT.format(workdir=shlex.quote(self.workdir.rstrip("/")), chromium=shlex.quote(CHROMIUM),
                              flags=shlex.join(CHROMIUM_FLAGS), seconds=f"{max(1.0, timeout - 4):g}")
        argv = ["sh", "-c", script, "sh", full, out, f"{width},{height}", "file://" + urllib.parse.quote(full)]
        try:
            r = self.sb.exec(argv, timeout=timeout, env=self.env, cwd=self.workdir)
            if r.timed_out or r.exit_code == 86:
                return ToolResult("", "screenshot", f"error: screenshot of {path} timed out after {timeout:g} s",
                                  error=True, meta={"timed_out": True, "timeout": timeout})
            if r.exit_code in _SHOT_ERRORS:
                return ToolResult("", "screenshot", f"error: {path}: {_SHOT_ERRORS[r.exit_code]}", error=True,
                                  meta={"exit_code": r.exit_code})
            try:
                png = self.sb.read_file(out, max_bytes=SCREENSHOT_MAX_BYTES + 1)
            except SandboxError:
                png = b""
        finally:
            try:
                self.sb.exec(["rm", "-f", "--", out], timeout=30, env=self.env, cwd="/")
            except SandboxError:
                pass
        if not r.ok or png[:8] != b"\x89PNG\r\n\x1a\n" or len(png) > SCREENSHOT_MAX_BYTES:
            err = "\n".join(line for line in r.stderr.decode("utf-8", "replace").splitlines()
                            if "dbus" not in line and line.strip())
            why = (f"the screenshot is over {SCREENSHOT_MAX_BYTES} bytes" if len(png) > SCREENSHOT_MAX_BYTES
                   else f"the browser failed (exit code {r.exit_code})")
            text, _ = _cap(f"error: screenshot of {path}: {why}" + (f"\n[stderr]\n{err}" if err else ""),
                           self.max_output)
            return ToolResult("", "screenshot", text, error=True, meta={"exit_code": r.exit_code})
        w, h = struct.unpack(">II", png[16:24])
        url = "data:image/png;base64," + base64.b64encode(png).decode("ascii")
        return ToolResult("", "screenshot", f"screenshot of {path}, {w}x{h}", images=[url],
                          meta={"width": w, "height": h, "bytes": len(png)})
