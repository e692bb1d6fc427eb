"""A lone request on an idle replica runs on the event loop's own thread, not handed to a core's
thread and back; anything else (a busy replica, a costly call, several chunks, requests that
overlap) is handed out as before. Which thread ran each stage is what the stage hook sees."""

import asyncio
import json
import threading

import pytest
import torch

from neuron_serve.runtime import lone
from neuron_serve.runtime.observer import RuntimeObserver
from neuron_serve.runtime.runner import ModelRunner
from neuron_serve.serve.infer.http import infer as rest_infer
from neuron_serve.serve.infer.plane import ModelDataPlane

TOLERANCE = 1e-5
LOOP = "MainThread"  # asyncio.run runs the loop on the test's own thread


class Threads(RuntimeObserver):
    """An observer that records (stage, thread name) for every stage run."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str]] = []

    def stage(self, partition, device, core, seconds) -> None:
        self.seen.append((partition, threading.current_thread().name))

    def take(self) -> list[tuple[str, str]]:
        seen, self.seen = self.seen, []
        return seen


@pytest.fixture(scope="module")
def hooked(built):
    threads = Threads()
    runner = ModelRunner(built, cores=1, name="scores", observer=threads)
    threads.take()  # the load-time timing runs
    yield runner, threads
    runner.close()


def test_an_idle_runner_runs_a_lone_chunk_on_the_calling_thread(hooked, eager):
    runner, threads = hooked
    x = torch.rand(4, 8)
    [[out]] = asyncio.run(runner.infer([[x]], inline=True))
    torch.testing.assert_close(out, eager(x), atol=TOLERANCE, rtol=TOLERANCE)
    assert threads.take() == [("accel_0", LOOP), ("cpu_0", LOOP)]


def test_without_inline_the_accelerator_stage_runs_on_the_cores_thread(hooked, eager):
    runner, threads = hooked
    x = torch.rand(4, 8)
    [[out]] = asyncio.run(runner.infer([[x]]))
    torch.testing.assert_close(out, eager(x), atol=TOLERANCE, rtol=TOLERANCE)
    [(stage, thread)] = [seen for seen in threads.take() if seen[0] == "accel_0"]
    assert thread.startswith("core0")


def test_a_call_costlier_than_the_inline_limit_is_handed_out(hooked, monkeypatch):
    runner, threads = hooked
    monkeypatch.setattr(lone, "INLINE_MAX_S", 0.0)
    asyncio.run(runner.infer([[torch.rand(4, 8)]], inline=True))
    assert dict(threads.take())["accel_0"].startswith("core0")


def test_rows_that_take_two_chunks_are_handed_out(hooked, eager):
    runner, threads = hooked
    rows = max(runner.model.batch_sizes) + 1  # more than the largest compiled call: two calls
    assert len(runner.plan(0, rows)) == 2
    x = torch.rand(rows, 8)
    [[out]] = asyncio.run(runner.infer([[x]], inline=True))
    torch.testing.assert_close(out, eager(x), atol=TOLERANCE, rtol=TOLERANCE)
    accel = [thread for stage, thread in threads.take() if stage == "accel_0"]
    assert len(accel) == 2 and all(thread.startswith("core0") for thread in accel)


def test_a_chunk_that_finds_another_on_a_core_is_handed_out(hooked, eager):
    runner, threads = hooked
    xs = [torch.rand(4, 8), torch.rand(4, 8)]

    async def together():
        # The first takes the core and waits on its thread; the second then finds it busy.
        return await asyncio.gather(runner.infer([[xs[0]]]), runner.infer([[xs[1]]], inline=True))

    for [[out]], x in zip(asyncio.run(together()), xs):
        torch.testing.assert_close(out, eager(x), atol=TOLERANCE, rtol=TOLERANCE)
    accel = [thread for stage, thread in threads.take() if stage == "accel_0"]
    assert len(accel) == 2 and all(thread.startswith("core0") for thread in accel)


def body(x: torch.Tensor) -> bytes:
    return json.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": list(x.shape),
                                   "data": x.flatten().tolist()}]}).encode()


def answer(content: bytes) -> torch.Tensor:
    [out] = json.loads(content)["outputs"]
    return torch.tensor(out["data"]).reshape(out["shape"])


def test_the_data_plane_runs_requests_one_at_a_time_on_the_loop_until_two_overlap(config, built, eager,
                                                                                monkeypatch):
    monkeypatch.setattr(lone, "ALONE_QUIET_S", 0.2)

    async def calls():
        plane = ModelDataPlane(config, built, replica="inline")
        plane.start()
        threads = Threads()
        for pipeline in plane.runner.pipelines[0].values():
            pipeline.observer = threads
        try:
            seen = {}
            xs = [torch.rand(1, 8) for _ in range(5)]
            outs = [answer((await rest_infer(plane, body(xs[0]), {}))[0])]
            seen["alone"] = dict(threads.take())["accel_0"]
            # Two at once: the first of them yields, the second comes in, and both go to the core.
            outs += [answer(content) for content, _ in
                     await asyncio.gather(*(rest_infer(plane, body(x), {}) for x in xs[1:3]))]
            seen["overlapping"] = {thread for stage, thread in threads.take() if stage == "accel_0"}
            outs.append(answer((await rest_infer(plane, body(xs[3]), {}))[0]))
            seen["right after"] = dict(threads.take())["accel_0"]
            await asyncio.sleep(0.25)  # ALONE_QUIET_S with no overlap: one at a time again
            outs.append(answer((await rest_infer(plane, body(xs[4]), {}))[0]))
            seen["quiet again"] = dict(threads.take())["accel_0"]
            return xs, outs, seen
        finally:
            await plane.stop()

    xs, outs, seen = asyncio.run(calls())
    for x, out in zip(xs, outs):
        torch.testing.assert_close(out, eager(x), atol=TOLERANCE, rtol=TOLERANCE)
    assert seen["alone"] == LOOP
    assert len(seen["overlapping"]) == 1 and next(iter(seen["overlapping"])).startswith("core0")
    assert seen["right after"].startswith("core0")
    assert seen["quiet again"] == LOOP
