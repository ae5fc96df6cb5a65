"""The manager's content-addressed store of file layers and snapshots (persisted on disk).

Layout under ``<root>/store``::

    objects/<k[:2]>/<k>   one regular file per distinct (content sha256, mode, uid, gid) = key k
    layers/<id>/          a directory tree in overlayfs layer format (whiteouts = 0:0 char devices,
                          opaque directories carry ``trusted.overlay.opaque``); its regular files
                          are hard links to objects, so a file shared by many layers is stored once
    layers/<id>.json      the layer's manifest: sorted entries (path, kind, mode, uid, gid, and
                          the object key / link target / device / opaque flag); id = sha256 of it
    snapshots/<id>.json   {image, layers (bottom -> top), parent, backend, ...};
                          id = sha256 of {image, layers, parent}

Committing a layer hashes each file once and adds only objects the store lacks, so a snapshot
grows the store by the bytes of files that changed, not by the sandbox's size.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import stat
import tempfile
import time

from k3.env.sandbox import SandboxError, SnapshotInfo

__all__ = ["Store", "hash_json", "default_root", "root_store"]

_SETTLED_NS = 2_000_000_000


def hash_json(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def default_root() -> str:
    """The sandbox manager's root: $K3_ENV_HOME, else ~/.cache/k3/env."""
    return os.environ.get("K3_ENV_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "k3", "env")


def root_store(root: str | None = None) -> "Store":
    """The image store of the manager rooted at ``root`` (None: ``default_root()``)."""
    return Store(os.path.join(os.path.realpath(root or default_root()), "store"))


class Store:
    def __init__(self, root: str):
        self.root = root
        # (dev, inode, size, mtime, ctime) -> sha256 of files this process already hashed. File
        # times are coarse (a tick of several ms), so only files unchanged for _SETTLED_NS are
        # remembered: a later write then surely moves ctime (git's "racy" rule)
        self._digests: dict[tuple, str] = {}
        for d in ("objects", "layers", "snapshots", "tmp"):
            os.makedirs(os.path.join(root, d), exist_ok=True)

    # layers ----------------------------------------------------------------------------------
    def layer_dir(self, layer_id: str) -> str:
        d = os.path.join(self.root, "layers", layer_id)
        if not os.path.isdir(d):
            raise SandboxError(f"store {self.root}: unknown layer {layer_id}")
        return d

    def _remember(self, stamp: tuple, digest: str) -> None:
        if time.time_ns() - max(stamp[3], stamp[4]) > _SETTLED_NS:
            self._digests[stamp] = digest

    def _key(self, digest: str, st: os.stat_result) -> tuple[str, str]:
        key = f"{digest}-{stat.S_IMODE(st.st_mode):o}-{st.st_uid}-{st.st_gid}"
        return key, os.path.join(self.root, "objects", key[:2], key)

    def _add_object(self, src: str, st: os.stat_result) -> tuple[str, str, int]:
        """Store ``src`` once; returns (key, object path, bytes added). The file is hashed first
        and copied only when the store lacks it (committing the same workspace again writes
        nothing, and in the same process reads nothing: digests are remembered by inode stamp);
        the copy is hashed again, so a file that changed meanwhile is keyed by what
        was actually stored."""
        stamp = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
        digest = self._digests.get(stamp)
        if digest is None:
            h = hashlib.sha256()
            with open(src, "rb") as fin:
                while chunk := fin.read(1 << 20):
                    h.update(chunk)
            digest = h.hexdigest()
        key, obj = self._key(digest, st)
        if os.path.exists(obj):
            self._remember(stamp, digest)
            return key, obj, 0
        h = hashlib.sha256()
        fd, tmp = tempfile.mkstemp(dir=os.path.join(self.root, "tmp"))
        try:
            with open(src, "rb") as fin, os.fdopen(fd, "wb") as fout:
                while chunk := fin.read(1 << 20):
                    h.update(chunk)
                    fout.write(chunk)
            key, obj = self._key(h.hexdigest(), st)
            self._remember(stamp, h.hexdigest())
            if os.path.exists(obj):
                return key, obj, 0
            os.makedirs(os.path.dirname(obj), exist_ok=True)
            os.chown(tmp, st.st_uid, st.st_gid)
            os.chmod(tmp, stat.S_IMODE(st.st_mode))
            size = os.path.getsize(tmp)
            os.replace(tmp, obj)
            tmp = ""
            return key, obj, size
        finally:
            if tmp:
                os.unlink(tmp)

    def commit_layer(self, src: str, prefix: str = "") -> tuple[str, int]:
        """Store the tree under ``src`` (placed at ``prefix`` inside the layer) as a layer.
        Returns (layer id, bytes the store grew by). Sockets and fifos are skipped."""
        tmp = tempfile.mkdtemp(dir=os.path.join(self.root, "tmp"), prefix="layer-")
        entries, added = [], 0
        try:
            dst_top = os.path.join(tmp, prefix) if prefix else tmp
            os.makedirs(dst_top, exist_ok=True)
            added = self._copy_tree(src, dst_top, prefix, entries)
            entries.sort()
            manifest = {"entries": entries}
            layer_id = hash_json(manifest)
            final = os.path.join(self.root, "layers", layer_id)
            if os.path.isdir(final):
                return layer_id, 0
            with open(final + ".json", "w") as f:
                json.dump(manifest, f)
            os.rename(tmp, final)
            tmp = ""
            return layer_id, added
        finally:
            if tmp:
                shutil.rmtree(tmp, ignore_errors=True)

    def _copy_tree(self, src: str, dst: str, rel: str, entries: list) -> int:
        added = 0
        for name in sorted(os.listdir(src)):
            s, d = os.path.join(src, name), os.path.join(dst, name)
            r = f"{rel}/{name}" if rel else name
            st = os.lstat(s)
            meta = [stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid]
            if stat.S_ISDIR(st.st_mode):
                os.mkdir(d)
                opaque = _get_xattr(s, "trusted.overlay.opaque")
                if opaque:
                    os.setxattr(d, "trusted.overlay.opaque", opaque)
                added += self._copy_tree(s, d, r, entries)
                os.chown(d, st.st_uid, st.st_gid)
                os.chmod(d, stat.S_IMODE(st.st_mode))
                entries.append([r, "dir", *meta, opaque.decode() if opaque else ""])
            elif stat.S_ISREG(st.st_mode):
                key, obj, n = self._add_object(s, st)
                added += n
                try:
                    os.link(obj, d)
                except OSError as e:  # too many links on one object: keep a private copy
                    if e.errno != errno.EMLINK:
                        raise
                    shutil.copy2(obj, d)
                entries.append([r, "file", *meta, key])
            elif stat.S_ISLNK(st.st_mode):
                target = os.readlink(s)
                os.symlink(target, d)
                os.lchown(d, st.st_uid, st.st_gid)
                entries.append([r, "symlink", *meta, target])
            elif stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode):
                os.mknod(d, st.st_mode, st.st_rdev)
                os.lchown(d, st.st_uid, st.st_gid)
                entries.append([r, "dev", *meta, f"{st.st_mode:o}:{st.st_rdev}"])
        return added

    # snapshots -------------------------------------------------------------------------------
    def add_blob(self, path: str) -> tuple[str, int]:
        """Store one file as a content-addressed object; returns (key, bytes the store grew by)."""
        key, _obj, n = self._add_object(path, os.stat(path))
        return key, n

    def blob_path(self, key: str) -> str:
        p = os.path.join(self.root, "objects", key[:2], key)
        if "/" in key or not os.path.isfile(p):
            raise SandboxError(f"store {self.root}: unknown blob {key}")
        return p

    def save_snapshot(self, image: str, layers: list[str], parent: str | None, backend: str,
                      nbytes: int, content: dict | None = None, meta: dict | None = None) -> SnapshotInfo:
        """Record a snapshot; id = sha256 of {image, layers, parent, backend, content} (``content``:
        backend-specific content keys, e.g. blob keys; ``meta``: free-form, not hashed)."""
        content = content or {}
        sid = hash_json({"image": image, "layers": layers, "parent": parent, "backend": backend,
                         "content": content})
        path = os.path.join(self.root, "snapshots", sid + ".json")
        if os.path.exists(path):
            return self.snapshot(sid)
        rec = {"id": sid, "image": image, "layers": layers, "parent": parent, "backend": backend,
               "created": time.time(), "bytes": nbytes, "content": content, "meta": meta or {}}
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(rec, f)
        os.replace(tmp, path)
        return self.snapshot(sid)

    def snapshot_record(self, sid: str) -> dict:
        if not isinstance(sid, str) or not sid or any(c not in "0123456789abcdef" for c in sid):
            raise SandboxError(f"snapshot id {sid!r}: not a hex snapshot id")
        try:
            with open(os.path.join(self.root, "snapshots", sid + ".json")) as f:
                return json.load(f)
        except FileNotFoundError:
            raise SandboxError(f"unknown snapshot {sid} (store {self.root})") from None

    def snapshot(self, sid: str) -> SnapshotInfo:
        r = self.snapshot_record(sid)
        return SnapshotInfo(id=r["id"], backend=r["backend"], parent=r["parent"], created=r["created"],
                            bytes=r["bytes"], meta={**r["meta"], "image": r["image"], "layers": r["layers"],
                                                    "content": r.get("content", {})})

    def snapshots(self) -> list[SnapshotInfo]:
        names = sorted(n[:-5] for n in os.listdir(os.path.join(self.root, "snapshots")) if n.endswith(".json"))
        return sorted((self.snapshot(n) for n in names), key=lambda s: s.created)

    def remove_snapshot(self, sid: str) -> None:
        self.snapshot_record(sid)
        os.unlink(os.path.join(self.root, "snapshots", sid + ".json"))

    def gc(self, live_layers: set[str], live_blobs: set[str] = frozenset()) -> dict:
        """Delete layers no snapshot or live sandbox uses, then objects no layer links to and no
        snapshot or live sandbox names as a blob. Leaves temporaries younger than an hour."""
        used, blobs = set(live_layers), set(live_blobs)
        for s in self.snapshots():
            used |= set(s.meta["layers"]) | {s.meta["image"]}
            blobs |= {v for v in s.meta["content"].values() if isinstance(v, str)}
        removed_layers = 0
        for n in os.listdir(os.path.join(self.root, "layers")):
            lid = n[:-5] if n.endswith(".json") else n
            if lid not in used:
                p = os.path.join(self.root, "layers", n)
                shutil.rmtree(p) if os.path.isdir(p) else os.unlink(p)
                removed_layers += not n.endswith(".json")
        freed = 0
        objdir = os.path.join(self.root, "objects")
        for sub in os.listdir(objdir):
            for n in os.listdir(os.path.join(objdir, sub)):
                p = os.path.join(objdir, sub, n)
                st = os.stat(p)
                if st.st_nlink == 1 and n not in blobs:
                    freed += st.st_size
                    os.unlink(p)
        tmpdir = os.path.join(self.root, "tmp")
        for n in os.listdir(tmpdir):
            p = os.path.join(tmpdir, n)
            if time.time() - os.lstat(p).st_mtime > 3600:
                shutil.rmtree(p, ignore_errors=True) if os.path.isdir(p) else os.unlink(p)
        return {"layers_removed": removed_layers, "bytes_freed": freed}

    def usage(self) -> int:
        """Bytes held by distinct objects (the store's payload)."""
        total = 0
        objdir = os.path.join(self.root, "objects")
        for sub in os.listdir(objdir):
            for n in os.listdir(os.path.join(objdir, sub)):
                total += os.stat(os.path.join(objdir, sub, n)).st_size
        return total


def _get_xattr(path: str, name: str) -> bytes:
    try:
        return os.getxattr(path, name, follow_symlinks=False)
    except OSError:
        return b""
