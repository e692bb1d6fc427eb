"""A serving task: infer replica with ``batch_sizes: auto`` changes its own compiled batch sizes for those its
chunks pad least: built as a replica builds it (serve/ray/deployment._build_plane: the compile queue, a background
compile), sent requests of 3 and 5 rows until a look is due, answering as the eager model before, during and after
the switch; the sizes it switches to worked out here by hand, the compiled-model budget kept, and a restart starting
on them."""

from __future__ import annotations

import asyncio
import time
import warnings
from pathlib import Path

import pytest
import torch
from prometheus_client import REGISTRY

from log_lines import capture
from neuron_serve.buckets import usage as bucket_usage
from neuron_serve.config.schema import parse_config
from neuron_serve.serve.protocols.infer import InferInput, InferRequest

HERE = Path(__file__).resolve().parents[2] / "models"  # two_stage_model.py
TOLERANCE = 1e-5  # float32, compiled on XLA:CPU against eager
COMMON = {"batch_sizes": "auto", "learn_buckets_after": 6, "batching": {"max_batch_size": 8, "max_queue_delay_ms": 1}}
CONFIGS = {
    # Two accelerator partitions around a CPU one, weights of their own draw.
    "two-stage-rebucket": {"model": {"factory": "two_stage_model:unseeded"}, "inputs": [{"name": "x", "shape": [4, 8]}],
                           "partitioner": {"model_support_percentage_threshold": 0.5}},
    # Two shape buckets along dim 1 (inputs of 5 columns run in the 6 bucket): each re-compiled at the new sizes.
    "row-sums-rebucket": {"model": {"factory": "two_stage_model:row_sums"}, "inputs": [{"name": "x", "shape": [2, 8]}],
                          "buckets": {"sizes": [6, 8], "inputs": {"x": 1}}},
}


def switches(name: str, outcome: str) -> float:
    return REGISTRY.get_sample_value("neuron_serve_bucket_switches_total", {
        "model": name, "replica": "test", "family": "rows", "outcome": outcome}) or 0.0


@pytest.fixture(scope="module", params=list(CONFIGS))
def run(request, tmp_path_factory):
    """The model on a new compile cache, on the default sizes [1, 4, 8] (nothing recorded yet) with a look every 6
    chunks; costs given so that 3 rows run as one 4-row chunk and 5 rows as one 8-row chunk."""
    from neuron_serve.compile import cache as compile_cache  # noqa: PLC0415

    name = request.param
    config = parse_config({"name": name, **CONFIGS[name], **COMMON})
    columns = 5 if "buckets" in CONFIGS[name] else 8  # row-sums: 5 columns, padded to its 6 bucket
    with warnings.catch_warnings():  # Ray Serve's own pydantic fields warn as it is imported
        warnings.simplefilter("ignore", DeprecationWarning)
        from neuron_serve.serve.ray.deployment import _build_plane  # noqa: PLC0415
    compile_cache.configure(tmp_path_factory.mktemp("rebucket") / "cache")
    try:
        plane = _build_plane(config, str(HERE), "test")
        assert plane.rebucket is not None
        deadline = time.monotonic() + 300
        while not plane.rebucket.ready():  # a look waits for the replica's own compile to end; so does the test
            assert time.monotonic() < deadline, plane.compile_state()
            time.sleep(0.2)
        plane.runner.use_costs([{1: 1.0, 4: 1.1, 8: 1.2}] * len(plane.runner.model.buckets))
        before = {"sizes": list(plane.runner.model.batch_sizes), "compiled": _compiled(plane)}
        module = plane.rebucket.built._module  # the factory's model, whose weights every compiled model holds

        async def main():
            plane.start()
            answers: dict[str, list] = {"before": [], "during": [], "after": []}
            try:
                for rows in (3, 5) * 10:  # one request at a time: a look starts once 6 chunks are recorded
                    answers["before"].append(await infer(plane, rows, columns))
                    await asyncio.sleep(0)  # the chunk is recorded on the loop's next turn
                    if plane.rebucket.thread is not None:
                        break
                look = plane.rebucket.thread
                assert look is not None, plane.metadata()["parameters"]["padding"]
                # Requests keep being answered while it compiles: one round of them (three at once, which the
                # batcher may join into one chunk), so the chunks recorded, and what a restart learns from them, do
                # not depend on how long the compile takes beside the other tests.
                if look.is_alive():
                    answers["during"].extend(await asyncio.gather(*(infer(plane, n, columns) for n in (3, 5, 2))))
                look.join()
                for rows in (3, 5, 8, 1, 7):
                    answers["after"].append(await infer(plane, rows, columns))
                again = await asyncio.get_running_loop().run_in_executor(None, plane.rebucket.look)
                return answers, plane.metadata(), again
            finally:
                await plane.stop()

        with capture() as lines:
            answers, metadata, again = asyncio.run(main())
        after = {"sizes": list(plane.runner.model.batch_sizes), "compiled": _compiled(plane)}
        restarted = bucket_usage.learned_batch_sizes(config).batch_sizes
        return {"name": name, "buckets": len(plane.runner.model.buckets), "before": before, "after": after,
                "answers": answers, "metadata": metadata, "again": again, "lines": lines, "module": module,
                "restarted": restarted}
    finally:
        compile_cache.configure()


def _compiled(plane) -> int:
    model = plane.runner.model
    return sum(len(model.grid(i)) for i in range(len(model.buckets)))


async def infer(plane, rows: int, columns: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.rand(rows, columns)
    answer = await plane.infer(InferRequest(None, [InferInput("x", "FP32", tuple(x.shape), x)]))
    return x, answer.outputs[0].tensor


def test_it_switches_to_the_batch_sizes_that_pad_its_chunks_least_within_the_same_budget(run):
    # Chunks of 3 and 5 rows on three sizes, 8 kept: [3, 5, 8] pads nothing, [1, 4, 8] pads 1 and 3 rows.
    assert run["before"]["sizes"] == [1, 4, 8]
    assert run["after"]["sizes"] == [3, 5, 8]
    assert run["after"]["compiled"] == run["before"]["compiled"] == 3 * run["buckets"]
    assert switches(run["name"], "switched") == 1 and switches(run["name"], "abandoned") == 0
    parameters = run["metadata"]["parameters"]
    assert parameters["batch_sizes"] == [3, 5, 8]
    assert parameters["batch_sizes_from"].startswith("traffic (") and parameters["batch_sizes_from"].endswith(
        " chunks, while serving)")
    assert parameters["rebucketing"] == {"every": 6, "switches": 1, "state": "serving"}


def test_every_answer_equals_eager_before_during_and_after_the_switch(run):
    assert run["answers"]["during"], "no request was answered while the new batch sizes compiled"
    with torch.no_grad():
        for phase, answered in run["answers"].items():
            for x, got in answered:
                torch.testing.assert_close(got, run["module"](x), atol=TOLERANCE, rtol=TOLERANCE,
                                           msg=lambda m, phase=phase, rows=len(x): f"{phase}, {rows} rows: {m}")


def test_a_restart_starts_on_the_batch_sizes_it_switched_to(run):
    assert run["restarted"] == run["after"]["sizes"]


def test_each_decision_is_logged_and_a_look_that_saves_too_little_keeps_the_sizes(run):
    lines, name, buckets = run["lines"], run["name"], run["buckets"]
    assert any(line.startswith(f"model {name}: switching batch sizes [1, 4, 8] -> [3, 5, 8] for the ")
               and " chunks recorded: padded work " in line for line in lines), lines
    # Each shape bucket compiles 3 and 5 rows and keeps its 8.
    assert any(line.startswith(f"model {name}: now on batch sizes [3, 5, 8] ({2 * buckets} compiled in ")
               and f" s, {buckets} kept); padded work " in line for line in lines), lines
    assert run["again"] is False
    assert any(line.startswith(f"model {name}: batch sizes [3, 5, 8] kept for the ") for line in lines), lines
