"""A serving pooling replica with ``length_buckets: auto`` changes its own length buckets for those its traffic pads
least: built as a replica builds it (serve/ray/pooling_deployment.build_plane, the compile queue, a background compile), sent
short texts until a look is due, answering right before, during and after the switch; the buckets it switches to
worked out here from the lengths by trying every choice, the compiled-model budget kept, and a restart starting on
them."""

from __future__ import annotations

import asyncio
import time
import warnings

import pytest
import torch
from prometheus_client import REGISTRY

from log_lines import capture
from neuron_serve.config.schema import parse_config
from neuron_serve.pooling import source
from neuron_serve.serve.protocols.pooling import PoolingRequest

NAME = "embedder-rebucket"  # a name of its own: the counters are the process's
TOLERANCE = 1e-5  # float32 against sentence-transformers' eager encode
SHORT = ["serve it", "a model", "batch rows", "pad less", "the core", "short text", "one two", "bucket"]
LONG = "Ready means every port answers for every model and deploy prints its ready line only then"


def switches(outcome: str) -> float:
    return REGISTRY.get_sample_value("neuron_serve_bucket_switches_total", {
        "model": NAME, "replica": "test", "family": "length", "outcome": outcome}) or 0.0


def best_first_bucket(lengths: list[int], largest: int) -> int:
    """The first of two buckets (the largest kept) that computes the fewest tokens for ``lengths``: every choice
    tried."""
    return min(range(1, largest), key=lambda b: (sum(b if n <= b else largest for n in lengths), b))


@pytest.fixture(scope="module")
def run(pooling_dirs, tmp_path_factory):
    """The embedder (defaults [32, 64], two batch sizes) on a new compile cache with auto buckets and a look every
    8 inputs: 8 short texts one at a time, texts during the switch, then the texts and LONG after it."""
    from neuron_serve.compile import cache as compile_cache  # noqa: PLC0415

    raw = {"name": NAME, "task": "embed", "model": {"pretrained": str(pooling_dirs["embedder"])},
           "pooling": {"length_buckets": "auto", "learn_buckets_after": 8}, "batch_sizes": [1, 4],
           "batching": {"max_batch_size": 4, "max_queue_delay_ms": 1}}
    config = parse_config(raw)
    with warnings.catch_warnings():  # Ray Serve's own pydantic fields warn as it is imported
        warnings.simplefilter("ignore", DeprecationWarning)
        from neuron_serve.serve.ray.pooling_deployment import build_plane  # noqa: PLC0415
    store = compile_cache.configure(tmp_path_factory.mktemp("rebucket") / "cache")
    try:
        plane = build_plane(config, None, "test")
        assert plane.rebucket is not None
        deadline = time.monotonic() + 300
        while not plane.rebucket.ready():  # a look waits for the replica's own compile to end; so does the test
            assert time.monotonic() < deadline, plane.data.compile_state()
            time.sleep(0.2)
        before = {"buckets": list(plane.spec.length_buckets), "compiled": _compiled(plane)}
        lengths = [len(r.ids) for r in plane.tokens.texts(SHORT)]

        async def main():
            plane.start()
            answers: dict[str, list] = {"before": [], "during": [], "after": []}
            try:
                for text in SHORT:  # one input a request: the 8th records the 8th length, and a look starts
                    answers["before"].append((text, await embed(plane, [text])))
                look = plane.rebucket.thread
                # Requests keep being answered while it compiles: one round of them, so the inputs recorded (and the
                # next look's proposal) do not depend on how long the compile takes beside the other tests.
                if look is not None and look.is_alive():
                    texts = SHORT[:3]  # three clients at once, texts of different lengths
                    for text, got in zip(texts, await asyncio.gather(*(embed(plane, [t]) for t in texts))):
                        answers["during"].append((text, got))
                    await asyncio.sleep(0.2)
                if look is not None:
                    look.join()
                for text in [*SHORT, LONG]:
                    answers["after"].append((text, await embed(plane, [text])))
                # A look at the same short lengths, now on their best buckets (LONG ran on 64, as before).
                again = await asyncio.get_running_loop().run_in_executor(None, plane.rebucket.look)
                return answers, plane.metadata(), again
            finally:
                await plane.stop()

        with capture() as lines:
            answers, metadata, again = asyncio.run(main())
        after = {"buckets": list(plane.spec.length_buckets), "compiled": _compiled(plane)}
        restarted = source.load(config)[1]
        return {"before": before, "after": after, "answers": answers, "metadata": metadata, "lengths": lengths,
                "restarted": restarted, "again": again, "lines": lines}
    finally:
        compile_cache.configure()


def _compiled(plane) -> int:
    model = plane.data.runner.model
    return sum(len(model.grid(i)) for i in range(len(model.buckets)))


async def embed(plane, texts: list[str]) -> torch.Tensor:
    with plane.data.begin() as call:
        return (await plane.pool(PoolingRequest("embed", texts=texts), call)).values


def test_it_switches_to_the_buckets_that_pad_its_traffic_least_within_the_same_budget(run):
    first = best_first_bucket(run["lengths"], 64)
    assert run["before"]["buckets"] == [32, 64]
    assert run["after"]["buckets"] == [first, 64], run["lengths"]
    assert run["after"]["compiled"] == run["before"]["compiled"] == 4  # 2 lengths x batch sizes [1, 4]
    assert switches("switched") == 1 and switches("abandoned") == 0
    parameters = run["metadata"]["parameters"]
    assert parameters["length_buckets"] == [first, 64]
    assert parameters["length_buckets_from"] == "traffic (8 inputs, while serving)"
    assert parameters["rebucketing"] == {"every": 8, "switches": 1, "state": "serving"}


def test_every_answer_equals_sentence_transformers_before_during_and_after_the_switch(run, pooling_dirs):
    from sentence_transformers import SentenceTransformer  # noqa: PLC0415

    eager = SentenceTransformer(str(pooling_dirs["embedder"]), device="cpu")
    assert run["answers"]["during"], "no request was answered while the new buckets compiled"
    for phase, answered in run["answers"].items():
        for text, got in answered:
            want = torch.from_numpy(eager.encode([text]))
            assert torch.allclose(got, want, atol=TOLERANCE), (phase, text, (got - want).abs().max())


def test_a_restart_starts_on_the_buckets_it_switched_to(run):
    """The lengths are kept in the compile cache when the replica stops: a new start learns the same buckets."""
    assert list(run["restarted"].length_buckets) == run["after"]["buckets"]


def test_each_decision_is_logged_and_a_look_that_saves_too_little_keeps_the_buckets(run):
    first = best_first_bucket(run["lengths"], 64)
    lines = run["lines"]
    assert any(line.startswith(f"model {NAME}: switching length buckets [32, 64] -> [{first}, 64] for the 8 inputs "
                               "recorded: padded work ") for line in lines), lines
    assert any(line.startswith(f"model {NAME}: now on length buckets [{first}, 64] (2 compiled in ")
               and " s, 2 kept); padded work " in line for line in lines), lines
    assert run["again"] is False
    assert any(line.startswith(f"model {NAME}: length buckets [{first}, 64] kept for the ")
               for line in lines), lines

