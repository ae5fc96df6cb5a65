"""The ``sh`` scripts the ``vm`` backend sends to its guest agent for exec and the file methods.

Paths are guest paths: relative ones are taken from the workspace. Nothing here can reach a host
file: the scripts run inside the VM, whose only link to the host is the agent's console.
"""

from __future__ import annotations

import re
import shlex

from k3.env.sandbox import FileEntry, SandboxError

_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_KINDS = {"regular file": "file", "regular empty file": "file", "directory": "dir", "symbolic link": "symlink"}


def guest_path(path: str, workdir: str) -> str:
    if not isinstance(path, str) or not path or "\0" in path or "\n" in path:
        raise SandboxError(f"vm: bad path {path!r} (empty, or has a NUL or newline)")
    return path if path.startswith("/") else f"{workdir.rstrip('/')}/{path}"


def exec_script(cmd: str | list[str], env: dict[str, str] | None, cwd: str) -> bytes:
    """``cd`` to ``cwd``, export ``env``, then the command (a string runs as ``sh`` script text,
    a list as argv)."""
    lines = [f"cd {shlex.quote(cwd)} || exit 126"]
    for k, v in (env or {}).items():
        if not _ENV_NAME.match(k):
            raise SandboxError(f"vm: exec env name {k!r} is not a shell variable name")
        lines.append(f"export {k}={shlex.quote(str(v))}")
    if isinstance(cmd, str):
        lines.append(cmd)
    elif isinstance(cmd, (list, tuple)) and cmd and all(isinstance(a, str) for a in cmd):
        lines.append("exec " + shlex.join(cmd))
    else:
        raise SandboxError(f"vm: exec cmd must be a string or a non-empty list of strings, got {cmd!r}")
    return ("\n".join(lines) + "\n").encode()


def read_script(path: str, workdir: str) -> bytes:
    p = shlex.quote(guest_path(path, workdir))
    return (f"p={p}\n"
            '[ -e "$p" ] || { echo "$p: no such file" >&2; exit 2; }\n'
            '[ -f "$p" ] || { echo "$p: not a regular file" >&2; exit 2; }\n'
            'exec cat "$p"\n').encode()


def write_script(path: str, workdir: str, mode: int) -> bytes:
    p = shlex.quote(guest_path(path, workdir))
    return (f"p={p}\n"
            '[ -d "$p" ] && { echo "$p: is a directory" >&2; exit 2; }\n'
            f'mkdir -p "$(dirname "$p")" && cat > "$p" && chmod {mode & 0o7777:o} "$p"\n').encode()


def list_script(path: str, workdir: str, recursive: bool) -> bytes:
    p = shlex.quote(guest_path(path, workdir))
    depth = "" if recursive else " -maxdepth 1"
    return (f"p={p}\n"
            '[ -d "$p" ] || { echo "$p: not a directory" >&2; exit 2; }\n'
            f"cd \"$p\" && find . -mindepth 1{depth} -exec stat -c '%F|%s|%n' {{}} +\n").encode()


def parse_list(out: bytes) -> list[FileEntry]:
    """``stat -c '%F|%s|%n'`` lines -> entries sorted by path (paths relative, no ``./``)."""
    entries = []
    for line in out.decode("utf-8", "surrogateescape").splitlines():
        kind, size, name = line.split("|", 2)
        k = _KINDS.get(kind, "other")
        entries.append(FileEntry(name[2:] if name.startswith("./") else name, k, int(size) if k == "file" else 0))
    return sorted(entries, key=lambda e: e.path)
