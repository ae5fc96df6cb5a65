"""Engine events into one asyncio event loop: one wake-up per engine step for all streams.

The engine thread puts each request's ``TokenEvent``s on its handle. ``EventBridge`` registers one
listener with the engine (``Engine.add_listener``), called after every step; it schedules a single
callback in the loop (coalesced: at most one pending at a time), which sets the ``asyncio.Event``
of every stream whose handle has something new. Each stream then drains its handle without
blocking (``RequestHandle.poll``). So per engine step the loop is woken once, whatever the number
of streams, and no thread per request competes with the engine thread for the interpreter.

No lost wake-up: a stream clears its event *before* checking ``handle.pending()``; an event put
after that check is followed by the listener call of the step that put it, whose callback runs
in the loop after the put and sets the event again.
"""

from __future__ import annotations

import asyncio
import threading

__all__ = ["EventBridge"]


class EventBridge:
    """``EventBridge(engine, loop)``; ``async for ev in bridge.events(handle)`` in that loop.
    ``close()`` unregisters the listener."""

    def __init__(self, engine, loop: asyncio.AbstractEventLoop):
        self.engine, self.loop = engine, loop
        self._waiting: dict = {}  # handle -> asyncio.Event of the stream reading it
        self._lock = threading.Lock()
        self._scheduled = False
        self.wakeups = 0  # loop callbacks run (one per engine step with listeners at most)
        engine.add_listener(self._on_step)

    def close(self) -> None:
        self.engine.remove_listener(self._on_step)

    def _on_step(self) -> None:
        """Engine thread: schedule one ``_wake`` unless one is already pending."""
        with self._lock:
            if self._scheduled or not self._waiting:
                return
            self._scheduled = True
        try:
            self.loop.call_soon_threadsafe(self._wake)
        except RuntimeError:  # the loop is closed (server shutting down): nobody is listening
            with self._lock:
                self._scheduled = False

    def _wake(self) -> None:
        """Loop thread: wake every stream whose handle has news."""
        with self._lock:
            self._scheduled = False
            items = list(self._waiting.items())
        self.wakeups += 1
        for handle, event in items:
            if handle.pending():
                event.set()

    async def events(self, handle):
        """The handle's TokenEvents; a failed request raises its error. Leaving early (the client
        went away: the task is cancelled) cancels the request in the engine."""
        event = asyncio.Event()
        with self._lock:
            self._waiting[handle] = event
        try:
            while True:
                for ev in handle.poll():
                    yield ev
                if handle.done:
                    if handle.error is not None:
                        raise handle.error
                    return
                event.clear()
                if not handle.pending():
                    await event.wait()
        finally:
            with self._lock:
                self._waiting.pop(handle, None)
            if not handle.done:
                handle.cancel()
