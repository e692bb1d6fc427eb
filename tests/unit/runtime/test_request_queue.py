"""DynamicBatcher: batch formation, queue bound, deadlines, error isolation, shutdown. No server."""

import asyncio
import re

import pytest
import torch

from neuron_serve.errors import ConfigError, Overloaded, RequestTimeout
from neuron_serve.runtime.observer import RuntimeObserver
from neuron_serve.runtime.request_queue import DynamicBatcher
from neuron_serve.runtime.request_rows import collate, split

DEFAULTS = dict(max_batch_size=8, max_queue_delay_s=0.01, max_queue_size=100, request_timeout_s=None)


class Recorder:
    """A run_batch that records each batch, optionally waits on a gate, and echoes items."""

    def __init__(self, gate: asyncio.Event | None = None, delay_s: float = 0.0):
        self.batches: list[list] = []
        self.started = asyncio.Event()
        self.gate = gate
        self.delay_s = delay_s

    async def __call__(self, items):
        self.batches.append(list(items))
        self.started.set()
        if self.gate is not None:
            await self.gate.wait()
        await asyncio.sleep(self.delay_s)
        return list(items)

    @property
    def ran(self):
        return [item for batch in self.batches for item in batch]


class Batches(RuntimeObserver):
    """An observer that hands each batch's (rows, queue waits) to ``on_batch``."""

    def __init__(self, on_batch):
        self.on_batch = on_batch

    def batch(self, rows, waits):
        self.on_batch(rows, waits)


def batcher(run_batch, on_batch=None, **overrides) -> DynamicBatcher:
    observer = Batches(on_batch) if on_batch is not None else None
    return DynamicBatcher(run_batch, **{**DEFAULTS, **overrides}, observer=observer)


def test_concurrent_distinct_tensors_each_get_their_own_result():
    sizes_seen = []

    async def run_batch(items):
        batched, sizes = collate([[x] for x in items], pad_to=16)
        sizes_seen.append(len(items))
        await asyncio.sleep(0.002)  # a model call, so requests pile up meanwhile
        return split(batched[0] * 2 + 1, sizes)

    async def main():
        async with batcher(run_batch, max_batch_size=16, max_queue_size=500) as b:
            inputs = [torch.full((1, 3), float(i)) for i in range(200)]
            results = await asyncio.gather(*(b.submit(x) for x in inputs))
            return inputs, results, b.stats

    inputs, results, stats = asyncio.run(main())
    for x, y in zip(inputs, results):
        torch.testing.assert_close(y, x * 2 + 1)
    assert sum(sizes_seen) == 200
    assert max(sizes_seen) > 1
    assert max(sizes_seen) <= 16
    assert stats["completed"] == 200 and stats["queued"] == 0 and stats["running_batches"] == 0


def test_max_batch_size_counts_rows_and_oversized_requests_run_alone():
    rows_per_batch = []

    async def main():
        async with batcher(Recorder(), max_batch_size=8, on_batch=lambda rows, waits: rows_per_batch.append(rows)) as b:
            await asyncio.gather(*(b.submit(f"r{i}", rows=3) for i in range(10)), b.submit("huge", rows=20))

    asyncio.run(main())
    assert 20 in rows_per_batch
    assert all(rows <= 8 for rows in rows_per_batch if rows != 20)
    assert sum(rows_per_batch) == 10 * 3 + 20


def test_lone_item_on_an_idle_batcher_runs_without_waiting_the_delay():
    waits = []

    async def main():
        async with batcher(Recorder(), max_queue_delay_s=30, on_batch=lambda rows, w: waits.extend(w)) as b:
            return await asyncio.wait_for(b.submit("alone"), timeout=5)

    assert asyncio.run(main()) == "alone"
    assert waits[0] < 5  # nothing was running, so waiting 30 s for company would only add latency


def test_a_lone_item_on_an_idle_batcher_runs_in_the_callers_task_and_others_batch_behind_it():
    async def main():
        gate = asyncio.Event()
        tasks = []

        async def run_batch(items):
            tasks.append(asyncio.current_task())
            await gate.wait()
            return list(items)

        async with batcher(run_batch, max_queue_delay_s=0.01, max_concurrent_batches=4) as b:
            first = asyncio.create_task(b.submit("first"))
            while not tasks:
                await asyncio.sleep(0)
            during = b.stats
            later = [asyncio.create_task(b.submit(name)) for name in ("second", "third")]
            await asyncio.sleep(0.05)  # past the delay: the two went as one batch, in the batcher's task
            gate.set()
            return await asyncio.gather(first, *later), tasks, first, during

    results, tasks, first, during = asyncio.run(main())
    assert results == ["first", "second", "third"]
    assert tasks[0] is first  # no hand-over to the batching task and back
    assert len(tasks) == 2 and tasks[1] is not first
    assert during["running_batches"] == 1 and during["queued"] == 0


def test_a_caller_that_goes_away_while_its_lone_item_runs_leaves_the_batcher_serving():
    async def main():
        gate = asyncio.Event()
        run = Recorder(gate)
        async with batcher(run, max_concurrent_batches=2) as b:
            gone = asyncio.create_task(b.submit("gone"))
            await run.started.wait()
            gone.cancel()
            with pytest.raises(asyncio.CancelledError):
                await gone
            after = b.stats
            gate.set()
            return await b.submit("next"), after, b.stats

    result, after, stats = asyncio.run(main())
    assert result == "next"
    assert (after["running_batches"], stats["running_batches"], stats["completed"]) == (0, 0, 1), (after, stats)


def test_while_a_batch_runs_a_new_batch_waits_the_delay_for_company():
    waits = []

    async def main():
        gate = asyncio.Event()
        run = Recorder(gate)
        async with batcher(run, max_batch_size=4, max_queue_delay_s=0.1, max_concurrent_batches=2,
                           on_batch=lambda rows, w: waits.extend(w)) as b:
            first = asyncio.create_task(b.submit("first"))
            await run.started.wait()  # "first" runs until the gate opens
            second = asyncio.create_task(b.submit("second"))
            await asyncio.sleep(0.03)
            third = asyncio.create_task(b.submit("third"))
            while len(run.batches) < 2:  # every batch waits on the gate; open it once the second started
                await asyncio.sleep(0.005)
            gate.set()
            return await asyncio.gather(first, second, third), run.batches

    results, batches = asyncio.run(main())
    assert results == ["first", "second", "third"]
    assert batches == [["first"], ["second", "third"]]  # the second batch waited and found company
    assert waits[0] < 0.09 <= waits[1]  # idle: at once; busy: the delay


def test_full_batch_dispatches_without_waiting_the_delay():
    async def main():
        async with batcher(Recorder(), max_batch_size=4, max_queue_delay_s=30) as b:
            return await asyncio.wait_for(asyncio.gather(*(b.submit(i) for i in range(4))), timeout=1)

    assert asyncio.run(main()) == [0, 1, 2, 3]


def test_reaching_the_largest_preferred_batch_size_dispatches_at_once():
    async def main():
        run = Recorder()
        async with batcher(run, max_batch_size=8, max_queue_delay_s=30, preferred_batch_sizes=[2, 4]) as b:
            await asyncio.wait_for(asyncio.gather(*(b.submit(i) for i in range(4))), timeout=1)
        return run.batches

    assert asyncio.run(main()) == [[0, 1, 2, 3]]


def test_full_queue_rejects_immediately_while_queued_requests_complete():
    async def main():
        gate = asyncio.Event()
        run = Recorder(gate)
        async with batcher(run, max_batch_size=1, max_queue_delay_s=0, max_queue_size=2) as b:
            first = asyncio.create_task(b.submit("a"))
            await run.started.wait()  # "a" is running, so the queue is empty again
            queued = [asyncio.create_task(b.submit(x)) for x in ("b", "c")]
            await asyncio.sleep(0)
            with pytest.raises(Overloaded, match=r"^queue full \(2 requests waiting\); retry later$"):
                await b.submit("d")
            gate.set()
            results = await asyncio.gather(first, *queued)
            return results, b.stats

    results, stats = asyncio.run(main())
    assert results == ["a", "b", "c"]
    assert stats["rejected"] == 1 and stats["completed"] == 3


def test_timeouts_raise_never_run_queued_items_and_the_batcher_keeps_serving():
    async def main():
        gate = asyncio.Event()
        run = Recorder(gate)
        async with batcher(run, max_batch_size=1, max_queue_delay_s=0, request_timeout_s=0.05) as b:
            running = asyncio.create_task(b.submit("running"))
            await run.started.wait()
            with pytest.raises(RequestTimeout, match=r"timed out after waiting 0\.05s \(still queued\)"):
                await b.submit("queued")
            with pytest.raises(RequestTimeout, match=r"timed out after waiting 0\.05s \(running\)"):
                await running
            gate.set()
            assert await b.submit("later") == "later"
            return run.ran, b.stats

    ran, stats = asyncio.run(main())
    assert "queued" not in ran  # timed out before its batch: never run
    assert ran == ["running", "later"]
    assert stats["timed_out"] == 2 and stats["completed"] == 1


def test_per_item_exception_fails_only_that_item():
    async def run_batch(items):
        return [ValueError(f"bad item {x}") if x == 2 else x * 10 for x in items]

    async def main():
        async with batcher(run_batch, max_queue_delay_s=0.05) as b:
            return await asyncio.gather(*(b.submit(i) for i in range(4)), return_exceptions=True)

    results = asyncio.run(main())
    assert results[:2] == [0, 10] and results[3] == 30
    assert isinstance(results[2], ValueError) and str(results[2]) == "bad item 2"


def test_exception_from_run_batch_fails_the_whole_batch():
    async def run_batch(items):
        raise RuntimeError("model crashed")

    async def main():
        async with batcher(run_batch, max_queue_delay_s=0.05) as b:
            results = await asyncio.gather(*(b.submit(i) for i in range(3)), return_exceptions=True)
            return results, b.stats

    results, stats = asyncio.run(main())
    assert [str(r) for r in results] == ["model crashed"] * 3
    assert all(isinstance(r, RuntimeError) for r in results)
    assert stats["failed"] == 3


def test_wrong_number_of_results_fails_the_batch_with_a_message():
    async def run_batch(items):
        return items[:1]

    async def main():
        async with batcher(run_batch, max_queue_delay_s=0.05) as b:
            return await asyncio.gather(*(b.submit(i) for i in range(2)), return_exceptions=True)

    for r in asyncio.run(main()):
        assert isinstance(r, RuntimeError)
        assert str(r) == "run_batch returned 1 results for 2 items; it must return one per item."


def test_a_broken_observer_does_not_break_serving():
    def on_batch(rows, waits):
        raise ZeroDivisionError

    async def main():
        async with batcher(Recorder(), on_batch=on_batch) as b:
            return await b.submit("x")

    assert asyncio.run(main()) == "x"


def test_concurrent_batches_run_at_once():
    async def main():
        gate = asyncio.Event()
        run = Recorder(gate)
        async with batcher(run, max_batch_size=1, max_queue_delay_s=0, max_concurrent_batches=3) as b:
            tasks = [asyncio.create_task(b.submit(i)) for i in range(3)]
            while len(run.batches) < 3:
                await asyncio.sleep(0.001)
            running = b.stats["running_batches"]
            gate.set()
            await asyncio.gather(*tasks)
            return running

    assert asyncio.run(main()) == 3


def test_stop_with_drain_completes_queued_items_then_refuses_new_ones():
    async def main():
        b = batcher(Recorder(), max_queue_delay_s=30)  # queued items would otherwise wait 30s
        b.start()
        tasks = [asyncio.create_task(b.submit(i)) for i in range(3)]
        await asyncio.sleep(0)
        await asyncio.wait_for(b.stop(drain=True), timeout=1)
        results = [t.result() for t in tasks]
        with pytest.raises(Overloaded, match="shutting down"):
            await b.submit("late")
        return results

    assert asyncio.run(main()) == [0, 1, 2]


def test_stop_without_drain_fails_queued_items_and_awaits_running_batches():
    async def main():
        gate = asyncio.Event()
        run = Recorder(gate)
        b = batcher(run, max_batch_size=1, max_queue_delay_s=0)
        b.start()
        running = asyncio.create_task(b.submit("running"))
        await run.started.wait()
        queued = [asyncio.create_task(b.submit(i)) for i in range(2)]
        await asyncio.sleep(0)
        stopping = asyncio.create_task(b.stop(drain=False))
        await asyncio.sleep(0.01)
        assert not stopping.done()  # still waiting for the running batch
        gate.set()
        await asyncio.wait_for(stopping, timeout=1)
        return running.result(), await asyncio.gather(*queued, return_exceptions=True), run.ran

    result, queued, ran = asyncio.run(main())
    assert result == "running"
    assert all(isinstance(r, Overloaded) and "shutting down" in str(r) for r in queued)
    assert ran == ["running"]


def test_submit_before_start_is_a_programming_error():
    async def main():
        await batcher(Recorder()).submit(1)

    with pytest.raises(RuntimeError, match=r"start\(\) must be called"):
        asyncio.run(main())


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("max_batch_size", 0),
        ("max_queue_delay_s", -0.1),
        ("max_queue_size", 0),
        ("request_timeout_s", 0),
        ("max_concurrent_batches", 0),
        ("preferred_batch_sizes", [4, 0]),
    ],
)
def test_invalid_config_names_the_parameter(name, value):
    with pytest.raises(ConfigError, match="^" + re.escape(f"DynamicBatcher: {name}={value!r} is invalid; it must be ")):
        batcher(Recorder(), **{name: value})


def test_invalid_config_message_says_the_accepted_range():
    with pytest.raises(ConfigError) as err:
        batcher(Recorder(), request_timeout_s=-1)
    assert str(err.value) == (
        "DynamicBatcher: request_timeout_s=-1 is invalid; it must be None (no deadline) or a number of seconds > 0."
    )


def test_request_timeout_none_and_zero_delay_are_valid():
    b = batcher(Recorder(), request_timeout_s=None, max_queue_delay_s=0)
    assert b.stats == {"queued": 0, "running_batches": 0, "completed": 0, "failed": 0, "rejected": 0, "timed_out": 0}
