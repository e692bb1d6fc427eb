"""DynamicBatcher.admit: the server's check before it reads a request body."""

import asyncio

from neuron_serve.errors import Overloaded
from neuron_serve.runtime.request_queue import DynamicBatcher


def refusal(batcher: DynamicBatcher) -> str | None:
    try:
        batcher.admit()
    except Overloaded as exc:
        return str(exc)
    return None


def test_admit_refuses_when_the_queue_is_full_and_when_stopping():
    async def main():
        release = asyncio.Event()

        async def run_batch(items):
            await release.wait()
            return items

        batcher = DynamicBatcher(run_batch, max_batch_size=1, max_queue_delay_s=0, max_queue_size=2,
                                 request_timeout_s=5, max_concurrent_batches=1)
        batcher.start()
        seen = [refusal(batcher)]
        tasks = []
        for i in range(3):  # the first runs (and blocks), the other two wait in the queue
            tasks.append(asyncio.create_task(batcher.submit(i)))
            await asyncio.sleep(0.02)
        seen.append(refusal(batcher))
        release.set()
        results = await asyncio.gather(*tasks)
        await batcher.stop()
        seen.append(refusal(batcher))
        return seen, results, batcher.stats

    seen, results, stats = asyncio.run(main())
    assert seen == [None, "queue full (2 requests waiting); retry later", "server shutting down; not accepting new requests"]
    assert results == [0, 1, 2]
    assert stats["rejected"] == 2 and stats["completed"] == 3
