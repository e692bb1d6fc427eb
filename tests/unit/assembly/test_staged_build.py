"""Ready on the first compiled models, the rest compiled in the background on the real compile
queue and joining the real runtime: answers equal eager whichever models exist at that moment."""

import asyncio
import json
import logging
import threading
from pathlib import Path

import pytest
import torch

from neuron_serve import metrics
from neuron_serve.assembly.from_config import StagedBuild
from neuron_serve.assembly.queue import CompileQueue
from neuron_serve.config.factory import build_model
from neuron_serve.config.schema import parse_config
from neuron_serve.errors import ConfigError
from neuron_serve.serve.infer.http import infer as rest_infer
from neuron_serve.serve.infer.plane import ModelDataPlane

HERE = Path(__file__).resolve().parents[1] / "models"  # per_position.py
TOLERANCE = 1e-5  # as the runtime's tests: XLA:CPU against eager PyTorch
WIDTH = 8
LENGTHS = (16, 8, 4)  # the buckets, largest first: a request of each length fills one exactly


def config(name: str, **changes) -> dict:
    base = {
        "name": name, "model": {"factory": "per_position:build", "kwargs": {"width": WIDTH}},
        "inputs": [{"name": "x", "shape": [4, 16, WIDTH]}], "outputs": ["y"],
        "partitioner": {"model_support_percentage_threshold": 0.5},
        "buckets": {"sizes": [4, 8, 16], "inputs": {"x": 1}, "outputs": {"y": 1}},
        "batch_sizes": [1, 4], "batching": {"max_batch_size": 4, "max_queue_delay_ms": 1},
    }
    base.update(changes)
    return base


def body(x: torch.Tensor) -> bytes:
    return json.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": list(x.shape),
                                   "data": x.flatten().tolist()}]}).encode()


class Paused:
    """Holds the compile queue's worker after the replica's first load and after each model joins,
    until the test lets it go on: the test then sees every stage of the background compile."""

    def __init__(self, queue: CompileQueue, group: str) -> None:
        self.joined, self.go = threading.Semaphore(0), threading.Semaphore(0)
        queue.subscribe(self._heard)
        self.group = group

    def _heard(self, job) -> None:
        if job.group == self.group and job.kind == "load" and job.done:
            self.joined.release()
            assert self.go.acquire(timeout=60)

    async def next_stage(self) -> None:
        self.go.release()
        await asyncio.get_running_loop().run_in_executor(None, self.joined.acquire)


async def _answers(plane: ModelDataPlane, eager: torch.nn.Module) -> None:
    """Requests of every length (1 to 16 positions) and of 1, 3 and 4 rows equal eager."""
    for length in (1, 3, 4, 7, 8, 13, 16):
        for rows in (1, 3, 4):
            x = torch.rand(rows, length, WIDTH)
            content, _ = await rest_infer(plane, body(x), {})
            out = torch.tensor(json.loads(content)["outputs"][0]["data"]).reshape(rows, length, WIDTH)
            torch.testing.assert_close(out, eager(x), atol=TOLERANCE, rtol=TOLERANCE)


def _serve(parsed, queue: CompileQueue, paused_stages: int | None, check) -> tuple[StagedBuild, list]:
    """Build ``parsed`` on ``queue`` as a replica does, serve it as each stage is reached, and run
    ``check(plane, stage)`` at each; returns the build and what each check returned."""
    build = StagedBuild(parsed, HERE, queue=queue)
    paused = Paused(queue, build.compiles.name) if paused_stages is not None else None
    planes: list[ModelDataPlane] = []

    def load(model):
        planes.append(ModelDataPlane(parsed, model, "staged", compiles=build.compiles))
        return planes[0]

    async def scenario():
        loop = asyncio.get_running_loop()
        starting = loop.run_in_executor(None, lambda: build.start(load, lambda model: planes[0].grow(model)))
        if paused is not None:
            await loop.run_in_executor(None, paused.joined.acquire)  # the first load, before ready
            paused.go.release()
        plane = await starting
        plane.start()
        seen = []
        try:
            for stage in range(paused_stages or 1):
                if stage and paused is not None:
                    await paused.next_stage()
                seen.append(await check(plane, stage))
            if paused is not None:
                paused.go.release()
            await loop.run_in_executor(None, build.finished.wait, 120)
            seen.append(await check(plane, "finished"))
        finally:
            await plane.stop()
        return seen

    return build, asyncio.run(scenario())


@pytest.fixture
def queue():
    q = CompileQueue("staged-test-queue")
    yield q
    q.close(timeout=60)


def test_ready_on_the_largest_bucket_then_each_compiled_model_joins_and_answers_equal_eager(queue, caplog):
    caplog.set_level(logging.INFO, logger="neuron_serve")
    parsed = parse_config(config("seqs"))
    eager = build_model(parsed, HERE)

    async def check(plane, stage):
        model = plane.runner.model
        await _answers(plane, eager)
        return (sorted((bucket.input_shapes[0][0][1], bucket.batch_size) for i in range(len(model.buckets))
                       for bucket in model.grid(i)), plane.metadata()["parameters"]["compile"])

    build, seen = _serve(parsed, queue, 6, check)
    shapes = [s for s, _ in seen]
    # Ready on bucket 16 at batch 4 alone; then one more compiled model at each stage, in the order
    # that saves the most padding; every answer before equal to eager.
    assert shapes[0] == [(16, 4)]
    assert [len(s) for s in shapes] == [1, 2, 3, 4, 5, 6, 6]
    assert all(set(a) < set(b) for a, b in zip(shapes, shapes[1:-1]))
    assert shapes[-1] == [(4, 1), (4, 4), (8, 1), (8, 4), (16, 1), (16, 4)]
    # The worker compiles the next model while the first stage is checked (only its join onto the core waits for
    # the test), so that one may be counted compiled already; nothing failed, and every model is counted.
    first = seen[0][1]
    assert first["compiled"] in (1, 2) and first["compiled"] + first["pending"] == 6, first
    assert (first["failed"], first["background"]) == (0, True)
    assert seen[-1][1] == {"compiled": 6, "pending": 0, "failed": 0, "background": True}
    lines = [r.getMessage() for r in caplog.records if r.name == "neuron_serve"]
    assert "compiled seqs bucket 3 batch 4 (1 of 6) in" in lines[lines.index(next(
        m for m in lines if m.startswith("compiled seqs bucket 3 batch 4")))]
    ready = next(m for m in lines if m.startswith("model seqs built in"))
    assert ready.endswith("; ready on 1 of 6 compiled models, the other 5 compile in the background")
    assert sorted(int(m.split("(")[1].split(" of")[0]) for m in lines if m.startswith("compiled seqs ")) == \
        [1, 2, 3, 4, 5, 6]
    finished = next(m for m in lines if m.startswith("model seqs: background compile finished"))
    assert finished.endswith(": 6 compiled models")  # a clean finish says no "failed"
    assert lines.index(finished) > lines.index(ready)


def test_a_background_compile_that_fails_is_logged_counted_and_serving_goes_on(queue, caplog):
    caplog.set_level(logging.INFO, logger="neuron_serve")
    parsed = parse_config(config("seqs-fail", model={"factory": "per_position:build",
                                                     "kwargs": {"width": WIDTH, "fail_at": 8}}))
    eager = build_model(parse_config(config("seqs")), HERE)  # the same weights, and no failure at 8
    labels = {"model": "seqs-fail", "replica": "staged"}

    async def check(plane, stage):
        await _answers(plane, eager)  # length 5 to 8 run on bucket 16, padded
        return plane.metadata()["parameters"]["compile"]

    build, seen = _serve(parsed, queue, None, check)
    state = seen[-1]
    assert {k: state[k] for k in ("compiled", "pending", "failed")} == {"compiled": 4, "pending": 0, "failed": 2}
    reason = "no kernel for sequences of length 8"
    assert sorted(f["model"] for f in state["failures"]) == ["seqs-fail bucket 2 batch 1", "seqs-fail bucket 2 batch 4"]
    assert all(reason in f["error"] for f in state["failures"])
    failed = [r.getMessage() for r in caplog.records if r.getMessage().startswith("compile of seqs-fail bucket 2")]
    assert len(failed) == 2 and all(reason in m for m in failed)
    finished = next(r.getMessage() for r in caplog.records
                    if r.getMessage().startswith("model seqs-fail: background compile finished"))
    assert ": 4 compiled models, 2 failed; seqs-fail bucket 2 batch" in finished and reason in finished
    assert metrics.COMPILED_MODELS.labels(**labels, state="failed")._value.get() == 2
    assert metrics.COMPILED_MODELS.labels(**labels, state="compiled")._value.get() == 4
    assert metrics.COMPILE_SECONDS.labels(**labels, bucket="bucket 3 batch 4")._value.get() > 0


def test_with_background_compile_off_everything_is_compiled_before_ready(queue):
    parsed = parse_config(config("seqs-steady", background_compile=False))

    async def check(plane, stage):
        model = plane.runner.model
        return sum(len(model.grid(i)) for i in range(len(model.buckets))), plane.metadata()["parameters"]["compile"]

    build, seen = _serve(parsed, queue, None, check)
    assert seen[0] == (6, {"compiled": 6, "pending": 0, "failed": 0, "background": False})


def test_a_start_up_compile_that_fails_fails_the_build_and_drops_the_rest(queue):
    parsed = parse_config(config("seqs-broken", model={"factory": "per_position:build",
                                                       "kwargs": {"width": WIDTH, "fail_at": 16}}))
    build = StagedBuild(parsed, HERE, queue=queue)
    with pytest.raises(Exception, match="no kernel for sequences of length 16"):
        build.start()
    assert [j.state for j in build.compiles.jobs() if j.kind == "compile"] == ["failed"] + ["cancelled"] * 5


def test_background_compile_must_be_a_boolean():
    with pytest.raises(ConfigError, match="background_compile: Input should be a valid boolean"):
        parse_config(config("seqs", background_compile="sometimes"))
