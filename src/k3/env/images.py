"""Base images: read-only root trees stored as content-addressed layers of the manager's store.

``default_image`` assembles a minimal root from the host: one Python interpreter with its standard
library (no site-packages), ``sh``/``bash`` and the coreutils-style tools in ``TOOLS``, the shared
libraries they load (from ``ldd``), and a small ``/etc`` of the sandbox's own (root and nobody
only, no host accounts). The image id is the layer id (sha256 of the tree's manifest); a recipe
fingerprint (paths, sizes, mtimes of every source file) maps a host state to it, so building
again on an unchanged host costs one ``stat`` walk and no copy.

``browser_image`` (``"browser"`` to ``SandboxManager.resolve_image``) is the default image plus the
host's Chromium (Debian's ``chromium`` package: ``/usr/lib/chromium`` without setuid files, the
shared libraries its ELF files load, fontconfig and the fonts), with ``/usr/bin/chromium`` a link
to the binary itself (not the package's launcher script): headless page rendering inside a
sandbox (the ``screenshot`` tool, pixel verifiers). Only tasks that ask for it pay for it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile

from k3.env.sandbox import SandboxError
from k3.env.store import Store, root_store

__all__ = ["default_image", "browser_image", "import_image", "TOOLS", "BROWSER_BIN"]

TOOLS = ("sh", "bash", "env", "true", "false", "echo", "printf", "cat", "ls", "cp", "mv", "rm", "ln",
         "mkdir", "rmdir", "touch", "chmod", "stat", "head", "tail", "wc", "sort", "uniq", "cut", "tr",
         "tee", "sed", "grep", "find", "xargs", "sleep", "test", "[", "dirname", "basename", "readlink",
         "realpath", "date", "id", "kill", "ps", "seq", "yes", "timeout", "dd", "du", "sha256sum",
         "md5sum", "diff", "cmp", "tar", "gzip", "uname", "hostname", "whoami", "pwd", "nproc", "mktemp",
         "printenv", "which", "awk", "chown", "truncate", "sync", "pkill", "pgrep")
RECIPE = "k3-default-image-v3"  # change when the recipe (tools, /etc, layout) changes
_SKIP_STDLIB = {"site-packages", "dist-packages", "test", "idlelib", "tkinter", "turtledemo",
                "ensurepip", "lib2to3", "pydoc_data"}
_ETC = {"passwd": "root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n",
        "group": "root:x:0:\nnogroup:x:65534:\n",
        "hosts": "127.0.0.1 localhost\n::1 localhost\n", "hostname": "k3-sandbox\n",
        "shadow": "root:*:19000:0:99999:7:::\n"}
BROWSER_RECIPE = "k3-browser-image-v1"
BROWSER_DIR = "/usr/lib/chromium"
BROWSER_BIN = BROWSER_DIR + "/chromium"
BROWSER_DATA = ("/etc/fonts", "/usr/share/fonts", "/usr/share/fontconfig")
_DIRS = ("tmp", "var/tmp", "workspace", "root", "proc", "dev", "sys", ".k3", "home", "usr/local/bin", "etc")


def _host_python(python: str | None) -> str:
    if python:
        return os.path.realpath(python)
    for cand in ("/usr/bin/python3", getattr(sys, "_base_executable", ""), sys.executable):
        if cand and os.path.isfile(os.path.realpath(cand)):
            return os.path.realpath(cand)
    raise SandboxError("images: no python3 interpreter found on the host for the default image")


def _python_dirs(py: str) -> list[str]:
    code = "import sysconfig,json;p=sysconfig.get_paths();print(json.dumps([p['stdlib'],p['platstdlib']]))"
    out = subprocess.run([py, "-I", "-S", "-c", code], capture_output=True, text=True, check=True).stdout
    return sorted({os.path.realpath(d) for d in json.loads(out)})


def _walk_files(d: str):
    for dirpath, dirnames, filenames in os.walk(d):
        dirnames[:] = [n for n in dirnames if n not in _SKIP_STDLIB]
        for n in filenames:
            yield os.path.join(dirpath, n)


def _ldd(paths: list[str]) -> set[str]:
    libs: set[str] = set()
    for i in range(0, len(paths), 200):
        r = subprocess.run(["ldd", *paths[i:i + 200]], capture_output=True, text=True)
        for line in r.stdout.splitlines():
            if not line[:1].isspace():  # "path:" headers when ldd is given several files
                continue
            part = line.split("=>")[-1].strip().split(" (")[0].strip()
            if part.startswith("/"):
                libs.add(part)
    return libs


def _sources(python: str | None) -> list[str]:
    py = _host_python(python)
    files = [py]
    for d in _python_dirs(py):
        files += list(_walk_files(d))
    path = "/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin"
    files += [p for t in TOOLS if (p := shutil.which(t, path=path))]
    files += [p for p in ("/bin/sh", "/bin/bash", "/usr/bin/env") if os.path.exists(p)]  # #! lines
    elfs = [f for f in files if f.endswith(".so") or f == py or "/bin/" in f]
    files += sorted(_ldd(elfs))
    return sorted(set(files))


def _add_host_path(stage: str, path: str, depth: int = 0) -> None:
    """Recreate ``path`` in ``stage``: every symlink on the way as a symlink, the file itself
    as a hard link to the host file when on the same filesystem, else a copy."""
    if depth > 16:
        raise SandboxError(f"images: too many symlinks resolving {path}")
    parts = path.strip("/").split("/")
    cur = "/"
    for i, p in enumerate(parts):
        cur = os.path.join(cur, p)
        dst = os.path.join(stage, cur.lstrip("/"))
        if os.path.islink(cur):
            target = os.readlink(cur)
            if not os.path.lexists(dst):
                os.makedirs(os.path.dirname(dst), exist_ok=True)
                os.symlink(target, dst)
            resolved = os.path.normpath(os.path.join(os.path.dirname(cur), target))
            rest = "/".join(parts[i + 1:])
            _add_host_path(stage, os.path.join(resolved, rest) if rest else resolved, depth + 1)
            return
        if i < len(parts) - 1:
            os.makedirs(dst, exist_ok=True)
        elif not os.path.lexists(dst):
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            try:
                os.link(cur, dst)
            except OSError:
                shutil.copy2(cur, dst)


def _browser_sources() -> list[str]:
    """The host's Chromium: its directory (no setuid/setgid file), fonts and fontconfig, and the
    shared libraries of its ELF files."""
    if not os.path.isfile(BROWSER_BIN) or not os.access(BROWSER_BIN, os.X_OK):
        raise SandboxError(f"images: the browser image needs the host's Chromium ({BROWSER_BIN} is missing; "
                           "apt-get install chromium)")
    files = []
    for top in (BROWSER_DIR, *BROWSER_DATA):
        for dirpath, _, filenames in os.walk(top):
            for n in filenames:
                p = os.path.join(dirpath, n)
                st = os.lstat(p)
                if stat.S_ISLNK(st.st_mode):
                    if os.path.isfile(p):  # a link to a file (fontconfig's conf.d); dangling ones are left out
                        files.append(p)
                elif stat.S_ISREG(st.st_mode) and not st.st_mode & (stat.S_ISUID | stat.S_ISGID):
                    files.append(p)
    elfs = [BROWSER_BIN] + [f for f in files if f.startswith(BROWSER_DIR + "/") and ".so" in os.path.basename(f)
                            and not os.path.islink(f)]
    return sorted(set(files) | _ldd(elfs))


def _fingerprint(files: list[str], recipe: str = RECIPE) -> str:
    h = hashlib.sha256(f"{recipe}\n{json.dumps([_ETC, TOOLS], sort_keys=True)}".encode())
    for f in files:
        st = os.stat(f)
        h.update(f"{f}\0{st.st_size}\0{st.st_mtime_ns}\0{st.st_mode}\n".encode())
    return h.hexdigest()


def import_image(store: Store, src: str) -> str:
    """Store an existing root tree (e.g. a debootstrap output) as an image; returns its id."""
    if not os.path.isdir(src):
        raise SandboxError(f"images: {src}: not a directory")
    stage = tempfile.mkdtemp(dir=os.path.join(store.root, "tmp"), prefix="image-")
    try:
        shutil.copytree(src, stage, symlinks=True, dirs_exist_ok=True, copy_function=_link_or_copy)
        _finish_root(stage)
        image_id, _ = store.commit_layer(stage)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    return image_id


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def _finish_root(stage: str) -> None:
    for d in _DIRS:
        os.makedirs(os.path.join(stage, d), exist_ok=True)
    for d in ("tmp", "var/tmp"):
        os.chmod(os.path.join(stage, d), 0o1777)
    os.chmod(os.path.join(stage, "root"), 0o700)
    open(os.path.join(stage, ".k3", "agent.py"), "a").close()  # mount point of the exec agent


def default_image(store: Store | str | None = None, python: str | None = None) -> str:
    """Build (once) and return the id of the default image: host Python + coreutils + own /etc.
    ``store``: a ``Store``, a manager root directory, or None for the default manager root."""
    return _image(store, python, RECIPE, (), lambda: _sources(python), {})


def browser_image(store: Store | str | None = None, python: str | None = None) -> str:
    """Build (once) and return the id of the browser image: the default image + the host's
    Chromium (module doc); SandboxError when the host has none."""
    return _image(store, python, BROWSER_RECIPE, (BROWSER_DIR, *BROWSER_DATA),
                  lambda: sorted(set(_sources(python)) | set(_browser_sources())), {"usr/bin/chromium": BROWSER_BIN})


def _image(store, python, recipe: str, dirs: tuple, sources, links: dict) -> str:
    if not isinstance(store, Store):
        store = root_store(store)
    quick = os.path.join(store.root, "images", "quick-" + _quick_key(python, recipe, dirs))
    image_id = _read_id(store, quick)
    if image_id:
        return image_id
    files = sources()
    fingerprint = os.path.join(store.root, "images", _fingerprint(files, recipe))
    image_id = _read_id(store, fingerprint)
    if not image_id:
        image_id = _build(store, files, _host_python(python), links)
        _write_id(fingerprint, image_id)
    _write_id(quick, image_id)
    return image_id


def _quick_key(python: str | None, recipe: str = RECIPE, extra_dirs: tuple = ()) -> str:
    """Cheap key of the host state: the interpreter and the mtimes of the directories sources
    come from (installing, removing or replacing a file there changes its directory's mtime)."""
    py = _host_python(python)
    dirs = [os.path.dirname(py), "/usr/bin", "/bin", "/usr/lib", "/lib", "/lib64",
            "/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", *extra_dirs]
    h = hashlib.sha256(f"{recipe}\0{py}\0{os.stat(py).st_mtime_ns}\0{json.dumps([_ETC, TOOLS])}".encode())
    for d in dirs:
        if os.path.isdir(d):
            h.update(f"{d}\0{os.stat(d).st_mtime_ns}\n".encode())
    return h.hexdigest()


def _read_id(store: Store, path: str) -> str:
    try:
        with open(path) as f:
            image_id = f.read().strip()
        store.layer_dir(image_id)
        return image_id
    except (OSError, SandboxError):
        return ""


def _write_id(path: str, image_id: str) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        f.write(image_id)
    os.replace(path + ".tmp", path)


def _build(store: Store, files: list[str], py: str, links: dict | None = None) -> str:
    stage = tempfile.mkdtemp(dir=os.path.join(store.root, "tmp"), prefix="image-")
    try:
        for f in files:
            _add_host_path(stage, f)
        _finish_root(stage)
        for name, text in _ETC.items():
            with open(os.path.join(stage, "etc", name), "w") as fh:
                fh.write(text)
        os.chmod(os.path.join(stage, "etc", "shadow"), 0o600)
        if not os.path.lexists(os.path.join(stage, "usr/bin/python3")):
            os.symlink(py, os.path.join(stage, "usr/bin/python3"))
        for rel, target in (links or {}).items():
            dst = os.path.join(stage, rel)
            if os.path.lexists(dst):
                os.unlink(dst)
            os.symlink(target, dst)
        image_id, _ = store.commit_layer(stage)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    return image_id


def image_names(store: Store) -> dict[str, str]:
    """Recipe fingerprint -> image id of every default image built in this store."""
    d = os.path.join(store.root, "images")
    out = {}
    for n in os.listdir(d) if os.path.isdir(d) else []:
        if not n.endswith(".tmp") and not n.startswith("quick-"):
            with open(os.path.join(d, n)) as f:
                out[n] = f.read().strip()
    return out
