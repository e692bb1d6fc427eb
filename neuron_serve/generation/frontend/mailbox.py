"""Events from an engine's thread to an event loop, with one wake-up per burst.

An engine step ends with an event for every running sequence, all emitted on the
engine's thread. Handing each to the loop with its own ``call_soon_threadsafe`` wakes
the loop once per token (a self-pipe write and a callback each), and the loop's
wake-ups compete with the engine for the GIL. A mailbox queues the events and wakes
the loop once for whatever arrived before it ran.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any, Callable


class Mailbox:
    """Delivers ``(deliver, item)`` pairs on ``loop``'s thread, in the order posted."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._lock = threading.Lock()
        self._items: list[tuple[Callable[[Any], None], Any]] = []
        self._scheduled = False

    def post(self, deliver: Callable[[Any], None], item: Any) -> None:
        """Call ``deliver(item)`` on the loop's thread soon (thread-safe)."""
        with self._lock:
            self._items.append((deliver, item))
            if self._scheduled:
                return
            self._scheduled = True
        try:
            self._loop.call_soon_threadsafe(self._flush)
        except RuntimeError:  # the loop is closed: nobody is left to read the events
            pass

    def _flush(self) -> None:
        with self._lock:
            items, self._items = self._items, []
            self._scheduled = False
        for deliver, item in items:
            deliver(item)
