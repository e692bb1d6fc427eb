"""ModelRunner: takes a built model and learns its compiled sizes and bucket choice from it."""

import asyncio
import time

import pytest
import torch

from neuron_serve.errors import InvalidInput
from neuron_serve.buckets import batch_sizes as sizes
from neuron_serve.runtime import runner as runner_module
from neuron_serve.runtime.observer import RuntimeObserver
from neuron_serve.runtime.runner import ModelRunner

TOLERANCE = 1e-5


class Chunks(RuntimeObserver, list):
    """Records (core, compiled batch size, padded rows) of every chunk."""

    def chunk(self, core, batch_size, padded):
        self.append((core, batch_size, padded))


@pytest.fixture(scope="module")
def runner(built):
    chunks = Chunks()
    runner = ModelRunner(built, cores=1, name="scores", observer=chunks)
    runner.recorded = chunks
    yield runner
    runner.close()


def test_every_compiled_size_is_loaded_on_every_core_and_timed(runner):
    # model.yaml has no batch_sizes: powers of 4 up to batching.max_batch_size (16), from the trace batch 4.
    assert runner.model.batch_sizes == [1, 4, 16]
    assert [b.batch_size for b in runner.model.grid(0)] == [1, 4, 16]
    [grid] = runner.pipelines
    assert sorted(grid) == [1, 4, 16]
    assert all(len(pipeline.modules) == 1 for pipeline in grid.values())  # one copy per core (one here)
    [costs] = runner.costs
    assert sorted(costs) == [1, 4, 16] and all(seconds > 0 for seconds in costs.values())


def test_a_burst_of_other_work_while_timing_raises_no_compiled_sizes_cost(runner, monkeypatch):
    # Another replica compiling beside this one stalls three calls in a row, as many as there
    # are sizes, right after the warm-up: each size loses one timed call of five, not its cost.
    [grid] = runner.pipelines
    calls, stall = [], 0.05
    for size, pipeline in grid.items():
        def run_blocking(*args, _run=pipeline.run_blocking, _size=size):
            calls.append(_size)
            if len(grid) < len(calls) <= 2 * len(grid):
                time.sleep(stall)
            return _run(*args)
        monkeypatch.setattr(pipeline, "run_blocking", run_blocking)
    [costs] = runner._measure(runner.pipelines)
    assert calls == [1, 4, 16] * 7  # a warm-up round, five timed rounds in turns, then the CPU stages' timing
    assert all(seconds < stall for seconds in costs.values()), costs


@pytest.mark.parametrize("limit, in_place", [(runner_module.IN_PLACE_CPU_S, {"cpu_0"}), (0.0, set())])
def test_cpu_stages_quicker_than_a_thread_hand_over_run_in_place(built, monkeypatch, limit, in_place):
    # The sort of at most 16 x 4 scores takes microseconds, well under the limit; with a
    # limit of 0 no stage is quick enough and every CPU stage goes to the pool.
    monkeypatch.setattr(runner_module, "IN_PLACE_CPU_S", limit)
    runner = ModelRunner(built, cores=1, name="scores")
    try:
        assert all(p.in_place == in_place for grid in runner.pipelines for p in grid.values())
    finally:
        runner.close()


class Fresh(torch.nn.Module):
    """An accelerator stage whose output tensors are marked as just made (the mark is not cloned)."""

    def __init__(self, stage: torch.nn.Module):
        super().__init__()
        self.stage = stage

    def forward(self, *args):
        out = self.stage(*args)
        for t in out if isinstance(out, (tuple, list)) else (out,):
            t.fresh = True
        return out


class ColdFirstCall(torch.nn.Module):
    """A CPU stage whose first call on an accelerator stage's output is slow (its inputs and
    code out of the caches); other calls run at the stage's own speed."""

    def __init__(self, stage: torch.nn.Module, cold_s: float):
        super().__init__()
        self.stage, self.cold_s = stage, cold_s

    def forward(self, *args):
        if any(getattr(a, "fresh", False) for a in args):
            for a in args:
                a.fresh = False
            time.sleep(self.cold_s)
        return self.stage(*args)


def test_a_cpu_stage_is_placed_by_its_own_work_not_by_a_cold_first_call(built):
    # Every first call takes twice the hand-over limit; the sort itself takes microseconds.
    runner = ModelRunner(built, cores=1, name="scores")
    try:
        for pipeline in runner.pipelines[0].values():
            [modules] = pipeline.modules
            modules["accel_0"] = Fresh(modules["accel_0"])
            pipeline.cpu_modules["cpu_0"] = ColdFirstCall(pipeline.cpu_modules["cpu_0"], 2 * runner_module.IN_PLACE_CPU_S)
            pipeline.run_in_place(set())
        runner._measure(runner.pipelines)
        assert all(p.in_place == {"cpu_0"} for p in runner.pipelines[0].values())
    finally:
        runner.close()


def test_rows_run_as_the_cheapest_measured_sizes_and_equal_eager(runner, eager):
    for rows in (1, 3, 4, 9, 16):
        runner.recorded.clear()
        x = torch.rand(rows, 8)
        [[out]] = asyncio.run(runner.infer([[x]]))
        assert out.shape == (rows, 4)
        torch.testing.assert_close(out, eager(x), atol=TOLERANCE, rtol=TOLERANCE)
        planned = sizes.plan(rows, runner.costs[0])
        assert sorted(size for _, size, _ in runner.recorded) == sorted(planned)
        assert sum(padded for *_, padded in runner.recorded) == sum(planned) - rows
    assert [p["device"] for p in runner.partitions] == ["neuron", "cpu"]


def test_given_costs_decide_which_sizes_run(built, eager):
    runner = ModelRunner(built, cores=1, name="scores")
    chunks = runner.observer = Chunks()
    try:
        # Costs of another machine: one 16-row call dearer than three 4-row calls and a 1-row call.
        runner.use_costs([{1: 1.0, 4: 1.5, 16: 10.0}])
        x = torch.rand(13, 8)
        [[out]] = asyncio.run(runner.infer([[x]]))
        torch.testing.assert_close(out, eager(x), atol=TOLERANCE, rtol=TOLERANCE)
        assert sorted(size for _, size, _ in chunks) == [1, 4, 4, 4]
        assert [padded for *_, padded in chunks] == [0, 0, 0, 0]
        assert runner.chunks == {(0, 4): 3, (0, 1): 1}

        runner.use_costs([{1: 1.0, 4: 1.5, 16: 2.0}])  # now one padded 16-row call is cheapest
        chunks.clear()
        [[out]] = asyncio.run(runner.infer([[x]]))
        torch.testing.assert_close(out, eager(x), atol=TOLERANCE, rtol=TOLERANCE)
        assert [(size, padded) for _, size, padded in chunks] == [(16, 3)]
    finally:
        runner.close()


def test_a_request_that_cannot_run_gets_its_error_and_the_others_their_results(runner, eager):
    good = torch.rand(2, 8)
    results = asyncio.run(runner.infer([[good], [torch.rand(2, 5)]]))
    torch.testing.assert_close(results[0][0], eager(good), atol=TOLERANCE, rtol=TOLERANCE)
    assert isinstance(results[1], InvalidInput)
    assert str(results[1]) == ("input 0 has shape (2, 5); with dynamic batching only dim 0 may differ from the "
                               "trace-time shape (16, 8).")


def test_costs_must_name_every_compiled_size(runner):
    with pytest.raises(ValueError, match=r"use_costs: give a cost for every compiled size of every bucket: \[\[1, 4, 16\]\]"):
        runner.use_costs([{1: 1.0, 4: 2.0}])
