"""The lone-request fast path: when a request may skip the hand-offs batching needs.

At concurrency 1 a request has no batch-mates to wait for, and the event loop has nothing
else to do while it runs, so the hand-offs that let requests overlap only cost it time.
This module decides when each is skipped; the others only ask it:

1. The request queue's (`skips_queue`, asked by ``DynamicBatcher.submit``): a request that
   finds the queue idle runs as a batch of its own in its caller's task, not handed to
   the batching task and back (three turns of the event loop).
2. The data plane's (`LoneRequests`): it counts the requests in flight, and says whether a
   batch's one request is alone (`LoneRequests.alone`): nothing else in flight, nothing
   overlapped for ``ALONE_QUIET_S``.
3. The runner's (`runs_inline`, asked by ``ModelRunner.infer`` for a request found alone):
   its batch runs on the event loop's own thread (``Pipeline.run(inline=True)``) rather
   than on the core's thread and back (about 0.2 ms of thread wake-ups on 2 vCPUs), when
   it is one compiled call, cheap enough, with nothing else on a core.
"""

from __future__ import annotations

import asyncio
import time

# A replica that has had no two requests in flight at once for this long serves one at a
# time (concurrency 1): its lone requests run on the event loop's thread.
ALONE_QUIET_S = 0.05
# Turns of the event loop a lone request gives before it takes the loop's thread, so that
# requests which reached the replica meanwhile come in and are counted (each turn ~5 µs).
ALONE_YIELDS = 3
# The longest compiled call (as timed at load) that runs on the event loop's own thread:
# the hand-out to a core's thread and back costs about 0.2 ms on 2 vCPUs, most of a small
# model's serving overhead, while the loop it blocks has nothing else to do. Longer calls
# would hold up arrivals for longer than that saves.
INLINE_MAX_S = 5e-3


def skips_queue(queued: int, running: int, slot_free: bool) -> bool:
    """Whether a request runs in its caller's task: nothing queued, no batch running, a batch slot free.

    It is what the batching task would do at once (nothing runs, so nothing is worth
    waiting for), without handing the request to that task and back.
    """
    return not queued and not running and slot_free


def runs_inline(call_costs: list[float], span: int, busy_cores: int) -> bool:
    """Whether a lone request's batch runs on the calling (event loop's) thread.

    ``call_costs`` are the seconds (timed at load) of the compiled calls the batch takes,
    every chunk of every shape bucket: it must be one call of at most ``INLINE_MAX_S``, of
    a model on one core (``span`` 1: a pipelined model's stages overlap on their cores),
    with no chunk on any core (``busy_cores``).
    """
    return len(call_costs) == 1 and call_costs[0] <= INLINE_MAX_S and span == 1 and busy_cores == 0


class LoneRequests:
    """The requests in flight on one replica (``arrived``/``left``), and whether one is alone."""

    def __init__(self) -> None:
        self.in_flight = 0  # requests between decode and answer
        self._overlapped = float("-inf")  # when two requests were last in flight at once

    def arrived(self, now: float) -> None:
        self.in_flight += 1
        if self.in_flight > 1:
            self._overlapped = now

    def left(self) -> None:
        self.in_flight -= 1

    def _alone(self) -> bool:
        return self.in_flight == 1 and time.perf_counter() - self._overlapped > ALONE_QUIET_S

    async def alone(self, requests: int) -> bool:
        """Whether a batch of ``requests`` is one request alone on the replica, so it may take the loop's thread.

        Only at concurrency 1: nothing else in flight, and nothing overlapped for
        ``ALONE_QUIET_S``. Requests that arrived while the loop was busy (running the
        previous lone request, say) get their turns first; if one comes in, this request
        is handed to a core as usual, and later ones are for ``ALONE_QUIET_S``, so a
        burst is batched rather than run one by one on the loop.
        """
        if requests != 1 or not self._alone():
            return False
        for _ in range(ALONE_YIELDS):
            await asyncio.sleep(0)
        return self._alone()
