"""The canonical tools every task is written against (SPEC §7.3): their names, arguments and
descriptions as task transcripts use them, and the check of one call's arguments. The agent layer
runs them over a sandbox (``k3.agent.tools``) and renames them per harness (``k3.agent.randomize``).

``OPT_IN_TOOLS`` (``screenshot``) are given only to tasks that list them: a task.toml without a
``[tools]`` table gets ``DEFAULT_TOOLS``, every tool but these.
"""

from __future__ import annotations

__all__ = ["TOOL_SPECS", "DEFAULT_TOOLS", "OPT_IN_TOOLS", "check_arguments"]

# name -> (description, {arg: (json type, required, description)})
TOOL_SPECS: dict[str, tuple[str, dict[str, tuple[str, bool, str]]]] = {
    "shell": ("Run a shell command (/bin/sh) in the working directory; returns exit code, stdout, stderr.",
              {"command": ("string", True, "the command line"),
               "timeout": ("number", False, "seconds before the command is killed (default 60)")}),
    "read": ("Read a text file.", {"path": ("string", True, "file path, relative to the working directory")}),
    "write": ("Create or overwrite a file with the given content.",
              {"path": ("string", True, "file path, relative to the working directory"),
               "content": ("string", True, "the whole new file content")}),
    "edit": ("Replace one exact occurrence of a string in a file (it must occur exactly once).",
             {"path": ("string", True, "file path, relative to the working directory"),
              "old": ("string", True, "the text to replace"), "new": ("string", True, "the replacement")}),
    "list": ("List a directory.", {"path": ("string", False, "directory, relative to the working directory")}),
    "submit": ("Submit the current work for grading by the hidden verifier (counts against the budget).", {}),
    "screenshot": ("Render a file of the working directory (a web page .html, or .svg, .png, ...) in a headless "
                   "browser without network and return the screenshot as an image.",
                   {"path": ("string", True, "file path, relative to the working directory"),
                    "width": ("integer", False, "viewport width in pixels, 64 to 1600 (default 640)"),
                    "height": ("integer", False, "viewport height in pixels, 64 to 1600 (default 480)")}),
}
OPT_IN_TOOLS = ("screenshot",)
DEFAULT_TOOLS = tuple(t for t in TOOL_SPECS if t not in OPT_IN_TOOLS)
_JSON_TYPES = {"string": str, "number": (int, float), "integer": int}


def check_arguments(name: str, args) -> str | None:
    """None if ``args`` fit the canonical schema of ``name``, else the problem (naming the arg)."""
    if name not in TOOL_SPECS:
        return f"unknown tool {name!r}"
    if not isinstance(args, dict):
        return f"{name}: arguments must be a JSON object"
    spec = TOOL_SPECS[name][1]
    for k in args:
        if k not in spec:
            return f"{name}: unknown argument {k!r} (expected {sorted(spec) or 'none'})"
    for k, (t, req, _) in spec.items():
        if k not in args:
            if req:
                return f"{name}: missing argument {k!r}"
            continue
        v = args[k]
        if isinstance(v, bool) or not isinstance(v, _JSON_TYPES[t]):
            return f"{name}: argument {k!r} must be {'an' if t[0] in 'aeiou' else 'a'} {t}"
    return None
