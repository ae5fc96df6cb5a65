"""What the file-layer backends (``namespace``, ``local``) share: a sandbox whose state is a dict
persisted by the manager, and snapshots made of store layers."""

from __future__ import annotations

from k3.env.sandbox import Limits, Sandbox, SandboxError, SnapshotInfo

__all__ = ["FILE_LAYER_BACKENDS", "file_layers", "StateSandbox"]

FILE_LAYER_BACKENDS = ("namespace", "local")


def file_layers(snap: SnapshotInfo, backend: str) -> tuple[list[str], str]:
    """(layers bottom -> top, image id) of a file-layer snapshot; refuses any other kind."""
    if snap.backend not in FILE_LAYER_BACKENDS or not snap.meta.get("image"):
        raise SandboxError(f"snapshot {snap.id} is a {snap.backend!r} snapshot: the {backend} backend can only "
                           f"start from file-layer snapshots ({', '.join(FILE_LAYER_BACKENDS)})")
    return list(snap.meta["layers"]), snap.meta["image"]


class StateSandbox(Sandbox):
    """A sandbox described by ``state`` (``manager.write_state``), attachable from any process."""

    def __init__(self, manager, state: dict):
        super().__init__(state["id"], Limits.from_dict(state["limits"]))
        self.manager, self.state = manager, state
        self.dir = manager.sandbox_dir(self.id)
        self._closed = False

    def _save(self) -> None:
        self.manager.write_state(self.id, self.state)

    def _check(self, running: bool = True) -> None:
        """Refuse a closed (or, with ``running``, a paused) sandbox. The state is read again
        first: another process may have paused, restored or closed it since we attached."""
        if self._closed:
            raise SandboxError(f"sandbox {self.id} is closed")
        try:
            self.state = self.manager.read_state(self.id)
        except SandboxError:
            self._closed = True
            raise SandboxError(f"sandbox {self.id} is closed (removed by another process)") from None
        if running and self.state.get("paused"):
            raise SandboxError(f"sandbox {self.id} is paused; resume() it first")

    def _record_snapshot(self, layers: list[str], added: int) -> str:
        info = self.manager.store.save_snapshot(self.state["image"], layers, self.state.get("origin"),
                                                self.backend, added,
                                                meta={"limits": self.limits.as_dict(), "sandbox": self.id,
                                                      "nested": bool(self.state.get("nested"))})
        return info.id

    def fork(self, snapshot_id: str | None = None) -> Sandbox:
        self._check(running=False)
        return self.manager.fork(snapshot_id or self.snapshot(), limits=self.limits, backend=self.backend)

    @property
    def closed(self) -> bool:
        return self._closed

    def describe(self) -> dict:
        return {**super().describe(), "image": self.state["image"], "origin": self.state.get("origin"),
                "paused": bool(self.state.get("paused"))}
