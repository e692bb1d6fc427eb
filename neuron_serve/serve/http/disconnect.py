"""Noticing that an HTTP client has gone while its answer is being made.

Starlette stops a streamed response when its client disconnects, but an answer awaited
in full (a non-streamed generation) would run to its end for nobody. Once the request
body has been read, the next ASGI message is the disconnect, so waiting for it beside
the work tells at once when to cancel the work (and so abort its sequences).
"""

from __future__ import annotations

import asyncio
from typing import Awaitable, TypeVar

from starlette.requests import Request
from starlette.types import Receive

T = TypeVar("T")


class ClientGone(Exception):
    """The client closed its connection before the answer was ready."""


async def _disconnect(receive: Receive) -> None:
    """Return when the client disconnects (call once the request body has been read)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """``work``'s answer, or ClientGone (``work`` cancelled, so its sequences abort) if the client leaves first."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnect(request.receive))
    try:
        done, _ = await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        watch.cancel()
    if task in done:
        return task.result()
    task.cancel()
    raise ClientGone()
