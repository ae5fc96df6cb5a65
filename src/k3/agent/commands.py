"""What a parsed shell command touches: ``shell_effects(line, cwd, home)`` -> a list of ``Effect``.

Each simple command of the line (``k3.agent.shell.parse_shell``) is classified by the program it
runs, after unwrapping wrappers (``env``, ``nice``, ``nohup``, ``timeout``, ``xargs``, ``command``,
``exec``, ...), recursing into shell strings (``bash -c``, ``sh -c``, ``eval``, ``find -exec``,
literal ``os.system``/``subprocess`` strings in ``python -c``), and reading its redirections.
An effect is a risk class (``RISKS``) plus, for reads/writes/deletes, the absolute path it names
(resolved lexically against the tracked ``cd``; ``None`` when only known at run time).

What is caught, by design: network programs (curl, wget, nc/ncat/netcat/socat, ssh/scp/sftp,
telnet, ftp, rsync to a host, ping, dig, ...), ``/dev/tcp`` redirections, git/hg network
subcommands, and ``python -c``/``perl -e``/``ruby -e``/``node -e`` code naming a socket or HTTP
module. Not caught: a program that opens a socket on its own (a script file, a compiled binary) —
the sandbox's empty network namespace is the boundary there; the policy is the first line.
"""

from __future__ import annotations

import ast
import posixpath
import re
from dataclasses import dataclass

from k3.agent.shell import ShellParseError, SimpleCommand, Word, parse_shell

__all__ = ["Effect", "RISKS", "shell_effects", "resolve_path"]

RISKS = ("read", "write", "delete", "execute", "network", "vcs_push", "package_install",
         "process_control", "privilege")

_NETWORK = {"curl", "wget", "nc", "ncat", "netcat", "socat", "ssh", "scp", "sftp", "telnet", "ftp",
            "ping", "ping6", "dig", "nslookup", "host", "whois", "traceroute", "aria2c", "lynx", "w3m",
            "links", "http", "https", "httpie", "sshpass", "mosh", "tftp"}
_PRIVILEGE = {"sudo", "su", "doas", "chroot", "nsenter", "unshare", "mount", "umount", "capsh", "setpriv",
              "pivot_root", "insmod", "rmmod", "modprobe", "sysctl", "iptables", "ip6tables", "nft"}
_PROCESS = {"kill", "pkill", "killall", "shutdown", "reboot", "halt", "poweroff", "systemctl", "service",
            "init", "telinit", "crontab", "at", "renice", "disown"}
_SHELLS = {"sh", "bash", "dash", "zsh", "ksh", "ash", "mksh", "busybox"}
_WRAPPERS = {"nohup", "time", "command", "builtin", "exec", "setsid", "stdbuf", "ionice", "nice", "chronic"}
_DELETE = {"rm", "rmdir", "unlink", "shred"}
_WRITE_OPERANDS = {"touch", "mkdir", "tee", "truncate", "chmod", "chown", "chgrp", "mkfifo"}
_COPY = {"cp", "mv", "install", "ln", "rsync"}
_PIP = {"pip", "pip3", "pipx", "easy_install", "uv", "poetry", "conda", "mamba", "micromamba", "pdm"}
_SYSPKG = {"apt", "apt-get", "aptitude", "dpkg", "yum", "dnf", "zypper", "apk", "pacman", "brew", "snap",
           "flatpak", "port", "nix-env", "rpm"}
_LANGPKG = {"npm", "pnpm", "yarn", "npx", "bun", "gem", "cargo", "go", "composer", "cpan", "cpanm"}
_PKG_VERBS = {"install", "i", "add", "ci", "sync", "uninstall", "remove", "upgrade", "update", "get",
              "download", "exec", "dlx", "x"}
_GIT_NETWORK = {"clone", "fetch", "pull", "ls-remote", "send-email", "request-pull", "archive"}
_CODE_NET = re.compile(r"\b(socket|urllib|urllib2|urllib3|http\.client|http\.server|httplib|requests|httpx|"
                       r"aiohttp|ftplib|smtplib|telnetlib|xmlrpc|paramiko|websocket|websockets|asyncio\."
                       r"open_connection|IO::Socket|Net::|LWP|TCPSocket|open-uri|net/http|"
                       r"require\(['\"](?:net|http|https|dgram|tls)['\"]\)|fetch\()")
_SPECIAL_FILES = {"/dev/null", "/dev/stdout", "/dev/stderr", "/dev/tty", "/dev/zero"}


@dataclass
class Effect:
    risk: str                  # one of RISKS
    path: str | None = None    # absolute path for read/write/delete; None = not a path or unknown
    dynamic: bool = False      # the path or program is only known at run time
    detail: str = ""           # the command (or reason) that produced it

    def as_dict(self) -> dict:
        return {"risk": self.risk, "path": self.path, "dynamic": self.dynamic, "detail": self.detail}


def resolve_path(text: str, cwd: str | None, home: str, *, dynamic: bool = False,
                 tilde: bool = True) -> str | None:
    """Absolute, lexically normalised path of ``text`` (``..`` folded, ``~`` -> home); None when the
    value is dynamic or relative to an unknown cwd."""
    if dynamic:
        return None
    if tilde and (text == "~" or text.startswith("~/")):
        text = home + text[1:]
    elif tilde and text.startswith("~"):
        return None  # ~user: another user's home, unknown
    if not text.startswith("/"):
        if cwd is None:
            return None
        text = posixpath.join(cwd, text)
    out = posixpath.normpath(text)
    return "/" + out.lstrip("/")


class _Analyzer:
    def __init__(self, cwd: str, home: str, depth: int = 0):
        self.cwd: str | None = cwd
        self.home = home
        self.depth = depth
        self.effects: list[Effect] = []

    def add(self, risk: str, word: Word | str | None = None, detail: str = ""):
        if word is None:
            self.effects.append(Effect(risk, None, False, detail))
            return
        w = word if isinstance(word, Word) else Word(word)
        p = resolve_path(w.text, self.cwd, self.home, dynamic=w.dynamic, tilde=not w.quoted)
        self.effects.append(Effect(risk, p, p is None, detail))

    def line(self, src: str, origin: str = "line"):
        for cmd in parse_shell(src, self.depth, origin):
            self.command(cmd)

    def command(self, cmd: SimpleCommand):
        detail = " ".join(cmd.argv)[:200]
        for r in cmd.redirects:
            self.redirect(r.op, r.target, detail)
        self.argv(cmd.words, detail)

    def redirect(self, op: str, target: Word, detail: str):
        if target.text.startswith(("/dev/tcp/", "/dev/udp/")):
            self.add("network", None, f"{op}{target.text}")
        elif op in ("<<", "<<-", "<<<"):
            return
        elif op in (">&", "<&") and (target.text.isdigit() or target.text == "-"):
            return
        elif op in ("<",):
            self.add("read", target, detail)
        elif not target.dynamic and target.text in _SPECIAL_FILES:
            return
        else:
            self.add("write", target, f"{detail} {op} {target.text}")

    def argv(self, words: list[Word], detail: str):
        while words:
            head = words[0]
            if head.dynamic:
                self.effects.append(Effect("execute", None, True, f"program only known at run time: {detail}"))
                return
            name = posixpath.basename(head.text)
            rest = words[1:]
            nxt = self._unwrap(name, rest)
            if nxt is None:
                self.program(name, rest, detail)
                return
            words = nxt

    def _unwrap(self, name: str, rest: list[Word]) -> list[Word] | None:
        """The command a wrapper runs, or None when ``name`` is no wrapper."""
        if name == "env":
            i = 0
            while i < len(rest) and (rest[i].text.startswith("-") or "=" in rest[i].text):
                i += 2 if rest[i].text in ("-u", "-C", "-S", "--chdir", "--unset") else 1
            return rest[i:]
        if name in ("timeout", "nice", "ionice", "stdbuf"):
            i = 0
            while i < len(rest) and rest[i].text.startswith("-"):
                i += 2 if rest[i].text in ("-n", "-s", "-k", "-c", "--signal", "--kill-after") else 1
            if name == "timeout":
                i += 1  # the duration
            return rest[i:]
        if name == "xargs":
            i = 0
            while i < len(rest) and rest[i].text.startswith("-"):
                i += 2 if rest[i].text in ("-n", "-I", "-P", "-d", "-L", "-s", "-E", "-a") else 1
            # its arguments come from stdin: unknown paths
            return rest[i:] + [Word("", dynamic=True)] if rest[i:] else [Word("echo")]
        if name in _WRAPPERS:
            i = 0
            while i < len(rest) and rest[i].text.startswith("-"):
                i += 1
            return rest[i:]
        return None

    def program(self, name: str, args: list[Word], detail: str):
        texts = [a.text for a in args]
        operands = _operands(args)
        if name in _PRIVILEGE:
            self.add("privilege", None, detail)
        elif name in _PROCESS:
            self.add("process_control", None, detail)
        elif name in _NETWORK or (name == "openssl" and texts[:1] == ["s_client"]):
            self.add("network", None, detail)
        elif name in _SHELLS or name == "eval":
            self._shell(name, args, detail)
        elif name in ("cd", "pushd", "popd"):
            self._cd(name, operands)
        elif name in _DELETE:
            for w in operands:
                self.add("delete", w, detail)
        elif name == "find":
            self._find(args, detail)
        elif name in _WRITE_OPERANDS:
            skip = 1 if name in ("chmod", "chown", "chgrp") else 0
            for w in operands[skip:]:
                self.add("write", w, detail)
        elif name in _COPY:
            self._copy(name, args, operands, detail)
        elif name == "dd":
            for a in args:
                if a.text.startswith(("of=", "if=")):
                    self.add("write" if a.text.startswith("of=") else "read",
                             Word(a.text[3:], a.dynamic, a.glob, a.quoted), detail)
        elif name in ("sed", "perl") and any(t.startswith("-i") or t == "--in-place" for t in texts):
            for w in operands[1:]:
                self.add("write", w, detail)
            if name == "perl":
                self._code(args, detail)
        elif name == "git":
            self._git(args, detail)
        elif name in ("hg", "svn", "fossil"):
            verb = operands[0].text if operands else ""
            self.add("vcs_push" if verb in ("push", "commit", "ci") and name != "hg" or verb == "push"
                     else "network" if verb in ("pull", "clone", "checkout", "co", "update") else "execute",
                     None, detail)
        elif name in _PIP or name in _SYSPKG or name in _LANGPKG:
            self._package(name, args, detail)
        elif re.fullmatch(r"python[0-9.]*|pypy[0-9.]*", name):
            self._python(args, detail)
        elif name in ("node", "nodejs", "ruby", "perl", "deno", "bun", "php", "lua"):
            self._code(args, detail)
            self.add("execute", None, detail)
        else:
            self.add("execute", None, detail)
            if name in ("tar", "unzip", "patch", "make"):
                self.add("write", Word("."), detail)

    # ---------------------------------------------------------------- programs with structure
    def _shell(self, name: str, args: list[Word], detail: str):
        texts = [a.text for a in args]
        if name == "eval":
            if any(a.dynamic for a in args):
                self.effects.append(Effect("execute", None, True, f"eval of a run-time value: {detail}"))
                return
            self._recurse(" ".join(texts), "eval")
            return
        if name == "busybox":
            if texts and texts[0] in _SHELLS:
                return self._shell(texts[0], args[1:], detail)
            return self.argv(args, detail)
        for i, t in enumerate(texts):
            if t.startswith("-") and "c" in t.lstrip("-") and not t.startswith("--"):
                if i + 1 >= len(args):
                    return self.add("execute", None, detail)
                script = args[i + 1]
                if script.dynamic:
                    self.effects.append(Effect("execute", None, True, f"{name} -c of a run-time value"))
                    return
                self._recurse(script.text, f"{name} -c")
                return
        self.add("execute", None, detail)  # a script file or stdin: its text is not visible here

    def _recurse(self, src: str, origin: str):
        sub = _Analyzer(self.cwd or "/", self.home, self.depth + 1)
        sub.cwd = self.cwd
        sub.line(src, origin)
        self.effects += sub.effects

    def _cd(self, name: str, operands: list[Word]):
        if name == "popd" or not operands:
            self.cwd = resolve_path("~", None, self.home) if name == "cd" and not operands else None
            return
        w = operands[0]
        if w.text == "-":
            self.cwd = None
            return
        self.cwd = resolve_path(w.text, self.cwd, self.home, dynamic=w.dynamic, tilde=not w.quoted)

    def _find(self, args: list[Word], detail: str):
        roots: list[Word] = []
        i = 0
        while i < len(args) and not args[i].text.startswith(("-", "(", "!")):
            roots.append(args[i])
            i += 1
        roots = roots or [Word(".")]
        while i < len(args):
            t = args[i].text
            if t == "-delete":  # deletes what matches below each root, and the root if it matches
                for r in roots:
                    self.add("delete", Word(posixpath.join(r.text, "*"), r.dynamic, True, r.quoted), detail)
            elif t in ("-exec", "-execdir", "-ok", "-okdir"):
                j = i + 1
                while j < len(args) and args[j].text not in (";", "+"):
                    j += 1
                for r in roots:  # {} is whatever matches below (or at) the root
                    below = Word(posixpath.join(r.text, "*"), r.dynamic, True, r.quoted)
                    self.argv([below if a.text == "{}" else a for a in args[i + 1:j]], detail)
                i = j
            elif t in ("-fprint", "-fprintf", "-fls"):
                if i + 1 < len(args):
                    self.add("write", args[i + 1], detail)
            i += 1
        for r in roots:
            self.add("read", r, detail)

    def _copy(self, name: str, args: list[Word], operands: list[Word], detail: str):
        if name == "rsync" and any(":" in a.text or a.text.startswith("rsync://") for a in operands):
            self.add("network", None, detail)
            return
        target = next((args[k + 1] for k, a in enumerate(args[:-1]) if a.text in ("-t", "--target-directory")),
                      None)
        dests = [target] if target is not None else operands[-1:]
        sources = operands if target is not None else operands[:-1]
        for w in dests:
            self.add("write", w, detail)
        for w in sources:
            self.add("delete" if name == "mv" else "read", w, detail)

    def _git(self, args: list[Word], detail: str):
        i = 0
        while i < len(args) and args[i].text.startswith("-"):
            i += 2 if args[i].text in ("-C", "-c", "--git-dir", "--work-tree", "--namespace") else 1
        verb = args[i].text if i < len(args) else ""
        sub = [a.text for a in args[i + 1:]]
        if verb == "push" or (verb == "remote" and sub[:1] == ["set-url"]):
            self.add("vcs_push", None, detail)
        elif verb in _GIT_NETWORK or (verb in ("remote", "submodule") and any(s in sub for s in ("update", "add"))):
            self.add("network", None, detail)
        elif verb == "clean":
            self.add("delete", Word("."), detail)
        else:
            self.add("execute", None, detail)
            if verb in ("checkout", "reset", "restore", "apply", "am", "merge", "rebase", "stash", "mv", "rm"):
                self.add("write", Word("."), detail)

    def _package(self, name: str, args: list[Word], detail: str):
        texts = [a.text for a in args if a.text not in ("-m",)]
        verbs = [t for t in texts if not t.startswith("-")]
        v0 = verbs[0] if verbs else ""
        if v0 in ("pip", "tool", "env", "global") and len(verbs) > 1:  # uv pip install, yarn global add
            v0 = verbs[1]
        flag_install = name in ("dpkg", "pacman", "rpm") and any(
            t in ("-i", "--install", "-U", "-S", "-Syu", "-Sy") for t in texts)
        if name == "npx" or v0 in _PKG_VERBS or flag_install:
            self.add("package_install", None, detail)
        else:
            self.add("execute", None, detail)

    def _python(self, args: list[Word], detail: str):
        texts = [a.text for a in args]
        for i, t in enumerate(texts):
            if t == "-m" and i + 1 < len(texts):
                mod = texts[i + 1]
                if mod in ("pip", "ensurepip", "pipx", "uv", "poetry", "conda"):
                    return self._package(mod, args[i + 2:] if mod != "ensurepip" else [Word("install")], detail)
                if mod.split(".")[0] in ("http", "smtpd", "ftplib", "xmlrpc", "urllib"):
                    return self.add("network", None, detail)
                return self.add("execute", None, detail)
            if t == "-c" and i + 1 < len(args):
                self._code(args, detail)
                self._python_code(args[i + 1])
                return self.add("execute", None, detail)
            if not t.startswith("-"):
                break
        self.add("execute", None, detail)

    def _code(self, args: list[Word], detail: str):
        for i, a in enumerate(args):
            if a.text in ("-c", "-e", "-E", "--eval", "-r", "-p") and i + 1 < len(args):
                if args[i + 1].dynamic:
                    self.effects.append(Effect("execute", None, True, "inline code of a run-time value"))
                elif _CODE_NET.search(args[i + 1].text):
                    self.add("network", None, f"inline code names a network module: {detail}")

    def _python_code(self, code: Word):
        """Shell strings a ``python -c`` program hands to ``os.system``/``subprocess`` literally."""
        try:
            tree = ast.parse(code.text)
        except (SyntaxError, ValueError):
            return
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call) or not node.args:
                continue
            fn = ast.unparse(node.func)
            if fn.split(".")[-1] not in ("system", "popen", "run", "call", "check_call", "check_output",
                                         "Popen", "getoutput", "getstatusoutput"):
                continue
            first = node.args[0]
            if isinstance(first, ast.Constant) and isinstance(first.value, str):
                self._recurse(first.value, "python -c")
            elif isinstance(first, (ast.List, ast.Tuple)) and all(
                    isinstance(e, ast.Constant) and isinstance(e.value, str) for e in first.elts):
                self.argv([Word(e.value) for e in first.elts], "python -c")
            else:
                self.effects.append(Effect("execute", None, True, "python -c runs a computed command"))


def _operands(args: list[Word]) -> list[Word]:
    """Non-option arguments (everything after ``--`` counts as an operand)."""
    out, opts = [], True
    for a in args:
        if opts and a.text == "--":
            opts = False
        elif opts and a.text.startswith("-") and a.text != "-" and not a.dynamic:
            continue
        else:
            out.append(a)
    return out


def shell_effects(line: str, cwd: str, home: str) -> list[Effect]:
    """Every effect of running ``line`` with ``cwd``; raises ``ShellParseError`` when unreadable."""
    a = _Analyzer(cwd, home)
    a.line(line)
    return a.effects


__all__ += ["ShellParseError"]
