"""File access inside a sandbox root that can never leave it.

Every path is opened with ``openat2(root_fd, path, RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS)``:
the kernel resolves ``..`` and every symlink (absolute or relative, planted anywhere on the path)
as if ``root`` were ``/``, so a link to ``/etc/shadow`` inside the sandbox means the sandbox's
own ``/etc/shadow``. Directories are created one component at a time under descriptors obtained
the same way. Sandbox paths: absolute = from the sandbox root, relative = from ``workdir``.
"""

from __future__ import annotations

import ctypes
import errno
import os
import posixpath
import stat

from k3.env.sandbox import FileEntry, SandboxError

__all__ = ["FsView"]

_SYS_OPENAT2 = 437
_RESOLVE_NO_MAGICLINKS = 0x02
_RESOLVE_IN_ROOT = 0x10
_libc = ctypes.CDLL(None, use_errno=True)


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


def _openat2(dirfd: int, path: str, flags: int, mode: int = 0) -> int:
    how = _OpenHow(flags | os.O_CLOEXEC, mode if flags & os.O_CREAT else 0,
                   _RESOLVE_IN_ROOT | _RESOLVE_NO_MAGICLINKS)
    fd = _libc.syscall(_SYS_OPENAT2, dirfd, os.fsencode(path), ctypes.byref(how), ctypes.sizeof(how))
    if fd < 0:
        e = ctypes.get_errno()
        if e == errno.ENOSYS:
            raise SandboxError("openat2 is missing (kernel < 5.6): file access into a sandbox is refused")
        raise OSError(e, os.strerror(e), path)
    return fd


class FsView:
    """Files of one sandbox: ``root`` is a host path of the sandbox's ``/``."""

    def __init__(self, root: str, workdir: str, label: str):
        self.root, self.workdir, self.label = root, workdir, label

    def rel(self, path: str) -> str:
        if not isinstance(path, str) or not path or "\0" in path:
            raise SandboxError(f"sandbox {self.label}: bad path {path!r}")
        full = posixpath.normpath(posixpath.join(self.workdir, path))
        return full.lstrip("/") or "."

    def _fail(self, path: str, e: OSError):
        return SandboxError(f"sandbox {self.label}: {path}: {e.strerror or e}")

    def _root_fd(self) -> int:
        try:
            return os.open(self.root, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as e:
            raise SandboxError(f"sandbox {self.label}: its root is gone ({e.strerror}); is it running?") from None

    def read(self, path: str, max_bytes: int | None = None) -> bytes:
        rfd = self._root_fd()
        try:
            fd = _openat2(rfd, self.rel(path), os.O_RDONLY | os.O_NONBLOCK)  # a planted fifo must not block
        except OSError as e:
            raise self._fail(path, e) from None
        finally:
            os.close(rfd)
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            os.close(fd)
            raise SandboxError(f"sandbox {self.label}: {path}: not a regular file")
        with os.fdopen(fd, "rb") as f:
            if max_bytes is not None and st.st_size > max_bytes:
                raise SandboxError(f"sandbox {self.label}: {path}: {st.st_size} bytes > max_bytes={max_bytes}")
            return f.read() if max_bytes is None else f.read(max_bytes)

    def _mkdirs(self, rfd: int, rel_dir: str) -> None:
        parts = [p for p in rel_dir.split("/") if p not in ("", ".")]
        cur = "."
        for p in parts:
            nxt = f"{cur}/{p}"
            try:
                os.close(_openat2(rfd, nxt, os.O_PATH | os.O_DIRECTORY))
            except FileNotFoundError:
                pfd = _openat2(rfd, cur, os.O_PATH | os.O_DIRECTORY)
                try:
                    os.mkdir(p, 0o755, dir_fd=pfd)
                except FileExistsError:
                    pass
                finally:
                    os.close(pfd)
            cur = nxt

    def write(self, path: str, data: bytes | str, mode: int = 0o644) -> None:
        if isinstance(data, str):
            data = data.encode()
        rel = self.rel(path)
        rfd = self._root_fd()
        try:
            self._mkdirs(rfd, posixpath.dirname(rel))
            fd = _openat2(rfd, rel, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NONBLOCK, mode)
        except OSError as e:
            raise self._fail(path, e) from None
        finally:
            os.close(rfd)
        with os.fdopen(fd, "wb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                raise SandboxError(f"sandbox {self.label}: {path}: not a regular file")
            f.write(data)
            os.fchmod(f.fileno(), mode)

    def list(self, path: str = ".", recursive: bool = False) -> list[FileEntry]:
        rfd = self._root_fd()
        try:
            dfd = _openat2(rfd, self.rel(path), os.O_RDONLY | os.O_DIRECTORY)
        except OSError as e:
            raise self._fail(path, e) from None
        finally:
            os.close(rfd)
        out: list[FileEntry] = []
        try:
            self._walk(dfd, "", recursive, out)
        finally:
            os.close(dfd)
        return sorted(out, key=lambda e: e.path)

    def _walk(self, dfd: int, prefix: str, recursive: bool, out: list[FileEntry]) -> None:
        for name in os.listdir(dfd):
            st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
            kind = ("dir" if stat.S_ISDIR(st.st_mode) else "file" if stat.S_ISREG(st.st_mode)
                    else "symlink" if stat.S_ISLNK(st.st_mode) else "other")
            rel = prefix + name
            out.append(FileEntry(rel, kind, st.st_size if kind == "file" else 0))
            if recursive and kind == "dir":
                try:
                    sub = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
                except OSError:
                    continue
                try:
                    self._walk(sub, rel + "/", True, out)
                finally:
                    os.close(sub)
