"""The agent's tools over a ``Sandbox`` (SPEC §7.3): shell, read, write, edit, list, submit.

``k3.tasks.tool_specs.TOOL_SPECS`` is the canonical schema (names and arguments as task transcripts
write them); ``tool_schemas(cfg, allowed)`` renders it as OpenAI ``tools`` under a harness config's renaming.
``ToolBox(sandbox).run(name, args, timeout_cap)`` executes one canonical call and returns a
``ToolResult``; bad arguments and failed operations are results with ``error=True`` (the model
sees why), never exceptions. Paths are relative to the sandbox workdir (``/workspace``). Output
shown to the model is capped at ``max_output`` characters per call (head and tail kept, the cut
stated). ``submit`` is not run here: the harness collects the submission (``k3.tasks.verify``).
"""

from __future__ import annotations

import posixpath

from k3.agent.randomize import HarnessConfig
from k3.agent.turns import ToolResult
from k3.env.sandbox import Sandbox, SandboxError
from k3.tasks.tool_specs import TOOL_SPECS, check_arguments

__all__ = ["ToolBox", "tool_schemas", "AGENT_ENV"]

AGENT_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/root", "LANG": "C.UTF-8"}
DEFAULT_SHELL_TIMEOUT = 60.0


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
