"""``SandboxManager``: creates, finds, forks, lists and garbage-collects sandboxes and snapshots.

Everything lives under one root (``$K3_ENV_HOME``, default ``~/.cache/k3/env``)::

    store/                 content-addressed layers, objects and snapshot records (k3.env.store)
    images/                default-image recipes -> image ids (k3.env.images)
    sandboxes/<id>/        one live sandbox: state.json (written by its backend) + backend files

A sandbox outlives the process that created it (``close``/``remove`` ends it), so another process
(``k3 env exec ID``) attaches to it from ``state.json``; snapshots persist until removed.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import shutil

from k3.env.backends import get_backend
from k3.env.images import browser_image, default_image, image_names
from k3.env.sandbox import Limits, Sandbox, SandboxError, SnapshotInfo
from k3.env.store import default_root, root_store

NAME_FILE = "name"   # a sandbox's name, in its directory, written before the backend makes it

__all__ = ["SandboxManager"]


class SandboxManager:
    def __init__(self, root: str | None = None):
        self.root = os.path.realpath(root or default_root())
        os.makedirs(os.path.join(self.root, "sandboxes"), exist_ok=True)
        self.store = root_store(self.root)
        self.tag = hashlib.sha256(self.root.encode()).hexdigest()[:8]

    # paths and state (used by backends) -------------------------------------------------------
    def sandbox_dir(self, sandbox_id: str) -> str:
        return os.path.join(self.root, "sandboxes", sandbox_id)

    def cgroup_name(self, sandbox_id: str) -> str:
        return f"k3-{self.tag}-{sandbox_id}"

    def write_state(self, sandbox_id: str, state: dict) -> None:
        path = os.path.join(self.sandbox_dir(sandbox_id), "state.json")
        with open(path + ".tmp", "w") as f:
            json.dump(state, f)
        os.replace(path + ".tmp", path)

    def read_state(self, sandbox_id: str) -> dict:
        if not isinstance(sandbox_id, str) or not sandbox_id or "/" in sandbox_id or sandbox_id.startswith("."):
            raise SandboxError(f"bad sandbox id {sandbox_id!r}")
        try:
            with open(os.path.join(self.sandbox_dir(sandbox_id), "state.json")) as f:
                return self._with_name(json.load(f))
        except FileNotFoundError:
            raise SandboxError(f"unknown sandbox {sandbox_id} (manager root {self.root})") from None

    def resolve_image(self, image: str) -> str:
        """"default" -> the default image, "browser" -> the browser image (each built once;
        k3.env.images); otherwise an existing image/layer id."""
        if image == "default":
            return default_image(self.store)
        if image == "browser":
            return browser_image(self.store)
        self.store.layer_dir(image)
        return image

    # sandboxes --------------------------------------------------------------------------------
    def _new_id(self, name: str | None) -> str:
        if name is not None:
            if not isinstance(name, str) or not name.replace("-", "").replace("_", "").isalnum() or len(name) > 40:
                raise SandboxError(f"sandbox name {name!r}: use letters, digits, - and _ (at most 40)")
            if any(s.get("name") == name for s in self.list()):
                raise SandboxError(f"sandbox name {name!r} is already in use")
        sid = "sb-" + secrets.token_hex(6)
        os.makedirs(self.sandbox_dir(sid))
        if name is not None:   # before the backend starts anything: a sandbox is never live unnamed
            with open(os.path.join(self.sandbox_dir(sid), NAME_FILE + ".tmp"), "w") as f:
                f.write(name)
            os.replace(os.path.join(self.sandbox_dir(sid), NAME_FILE + ".tmp"),
                       os.path.join(self.sandbox_dir(sid), NAME_FILE))
        return sid

    def _with_name(self, state: dict) -> dict:
        """``state`` with the sandbox's name (kept in its own file, beside the backend's state)."""
        try:
            with open(os.path.join(self.sandbox_dir(state["id"]), NAME_FILE)) as f:
                state["name"] = f.read()
        except (OSError, KeyError):
            state.setdefault("name", None)
        return state

    def create(self, image: str = "default", limits: Limits | None = None, backend: str = "namespace",
               workspace: str | None = None, name: str | None = None, nested: bool = False) -> Sandbox:
        """``nested``: the sandbox's root may isolate the processes it starts from itself (their own
        PID/mount namespaces, a second uid): what the verifier needs (k3.tasks.vharness). Only the
        namespace backend has it; the others refuse it."""
        limits = Limits() if limits is None else limits
        if not isinstance(limits, Limits):
            raise SandboxError(f"limits must be a k3.env.Limits, got {type(limits).__name__}")
        if workspace is not None and not os.path.isdir(workspace):
            raise SandboxError(f"workspace {workspace}: not a directory")
        cls = get_backend(backend)
        image_id = self.resolve_image(image)
        sid = self._new_id(name)
        try:
            sb = cls.create(self, sid, image_id, limits, workspace, nested=bool(nested))
        except BaseException:
            self._discard(sid)
            raise
        return sb

    def fork(self, snapshot_id: str, limits: Limits | None = None, backend: str | None = None,
             name: str | None = None) -> Sandbox:
        snap = self.store.snapshot(snapshot_id)
        backend = backend or snap.backend
        cls = get_backend(backend)
        limits = Limits.from_dict(snap.meta["limits"]) if limits is None and "limits" in snap.meta else limits
        limits = Limits() if limits is None else limits
        sid = self._new_id(name)
        try:
            sb = cls.fork(self, snap, sid, limits)
        except BaseException:
            self._discard(sid)
            raise
        return sb

    def _discard(self, sid: str) -> None:
        shutil.rmtree(self.sandbox_dir(sid), ignore_errors=True)

    def _lookup(self, id_or_name: str) -> str:
        if isinstance(id_or_name, str) and os.path.exists(os.path.join(self.sandbox_dir(id_or_name), "state.json")):
            return id_or_name
        for s in self.list():
            if s.get("name") == id_or_name:
                return s["id"]
        raise SandboxError(f"unknown sandbox {id_or_name!r} (manager root {self.root})")

    def get(self, id_or_name: str) -> Sandbox:
        """Attach to a live sandbox by id or name (works from any process)."""
        state = self.read_state(self._lookup(id_or_name))
        return get_backend(state["backend"]).attach(self, state)

    def list(self) -> list[dict]:
        """Every sandbox with a state file: its state dict (id, backend, name, image, ...)."""
        out = []
        d = os.path.join(self.root, "sandboxes")
        for sid in sorted(os.listdir(d)):
            try:
                with open(os.path.join(d, sid, "state.json")) as f:
                    out.append(self._with_name({"id": sid, **json.load(f)}))
            except (OSError, ValueError):
                continue
        return out

    def unmade(self) -> list[tuple[str, str | None]]:
        """(id, name) of every sandbox directory without a state: one being made now, or one whose
        maker died while making it."""
        d = os.path.join(self.root, "sandboxes")
        out = []
        for sid in sorted(os.listdir(d)):
            if not os.path.exists(os.path.join(d, sid, "state.json")):
                try:
                    with open(os.path.join(d, sid, NAME_FILE)) as f:
                        name = f.read()
                except OSError:
                    name = None
                out.append((sid, name))
        return out

    def remove_unmade(self, sid: str) -> None:
        """Remove a sandbox whose maker died while making it (only then: a live maker's sandbox
        would be pulled from under it): its cgroups (named after its id, the namespace backend's),
        their processes killed, and its directory."""
        from k3.env.cgroups import Cgroup, detect_layout

        cg = Cgroup(self.cgroup_name(sid), detect_layout())
        if any(os.path.isdir(x) for x in cg.dirs):
            cg.kill_all()
            cg.remove()
        shutil.rmtree(self.sandbox_dir(sid), ignore_errors=True)

    def remove(self, id_or_name: str) -> None:
        self.get(id_or_name).close()

    # snapshots --------------------------------------------------------------------------------
    def snapshots(self) -> list[SnapshotInfo]:
        return self.store.snapshots()

    def snapshot_info(self, snapshot_id: str) -> SnapshotInfo:
        return self.store.snapshot(snapshot_id)

    def remove_snapshot(self, snapshot_id: str) -> None:
        self.store.remove_snapshot(snapshot_id)

    def gc(self) -> dict:
        """Close sandboxes whose processes are gone (their backend's ``attach`` + ``close``),
        remove sandbox directories without a state (and their cgroups), then layers/objects
        nothing references."""
        closed = []
        for sid, _ in self.unmade():
            self.remove_unmade(sid)
        for state in self.list():
            cls = get_backend(state["backend"])
            alive = getattr(cls, "alive", None)
            if alive is not None and not alive(self, state):
                cls.attach(self, state).close()
                closed.append(state["id"])
        live, blobs = set(image_names(self.store).values()), set()
        for state in self.list():
            live |= set(state.get("layers", [])) | ({state["image"]} if state.get("image") else set())
            blobs |= set(state.get("blobs", []))
        return {"sandboxes_closed": closed, **self.store.gc(live, blobs)}
