"""The background compile follows the traffic a model got: with sizes recorded in the compile cache, a task: infer
model's shape buckets and a generate model's prefill lengths compile the ones the traffic uses most first (each next
model the one that saves the most padding for those sizes); with none recorded, the order the traffic is unknown to."""

from __future__ import annotations

import logging
from pathlib import Path

import generation_models as gm
from neuron_serve.buckets import usage as bucket_usage
from neuron_serve.assembly.grid import Entry, GridBuild
from neuron_serve.buckets.generation import GenerationBuckets
from neuron_serve.buckets.order import compile_order, expected_padding
from neuron_serve.config.schema import parse_config
from neuron_serve.generation.compiling.compile import GenerationBuild
from neuron_serve.generation.compiling import compile as compiling

HERE = Path(__file__).resolve().parents[1] / "models"  # two_stage_model.py
BUCKETED = {"name": "row-sums-order", "model": {"factory": "two_stage_model:row_sums"},
            "inputs": [{"name": "x", "shape": [2, 16]}], "buckets": {"sizes": [4, 8, 16], "inputs": {"x": 1}},
            "batch_sizes": [2, 4], "batching": {"max_batch_size": 4}}


def record(store, model: str, family: str, sizes: dict[int, int]) -> None:
    """Another replica's sizes, kept in the compile cache when it stopped."""
    usage = bucket_usage.Usage(model, "earlier", store.root)
    for size, times in sizes.items():
        usage.sizes.record(family, size, times)
    usage.save()


def test_an_infer_models_recorded_sizes_put_the_shape_bucket_they_use_first(fresh_cache, caplog):
    config = parse_config(BUCKETED)
    shapes, rows = [[4], [8], [16]], 4
    unknown = GridBuild(config, HERE).order
    assert unknown == [Entry(b, n) for b, n in compile_order(shapes, [2, 4], rows, [(2, 4)])]
    record(fresh_cache, "row-sums-order", "shape", {3: 90, 7: 10})  # 90% in the 4 bucket, 10% in the 8
    with caplog.at_level(logging.INFO, logger="neuron_serve"):
        order = GridBuild(config, HERE).order
    assert "model row-sums-order: compile order for the 100 request sizes recorded (4: 90%, 8: 10%, 16: 0%)" \
        in caplog.messages
    weights = (0.9, 0.1, 0.0)
    assert order[0] == Entry(2, 4) and order[1].bucket == 0 != unknown[1].bucket
    # Each next model saves at least as much padding on the recorded sizes as any model after it would.
    done = {(e.bucket, e.batch) for e in order[:1]}
    for k in range(1, len(order)):
        chosen = expected_padding(done | {(order[k].bucket, order[k].batch)}, shapes, rows, weights)
        assert all(chosen <= expected_padding(done | {(e.bucket, e.batch)}, shapes, rows, weights)
                   for e in order[k:])
        done.add((order[k].bucket, order[k].batch))


def test_a_generate_models_recorded_prompts_put_the_prefill_they_use_most_first(fresh_cache, caplog):
    buckets = GenerationBuckets.build(4, 48, prefill=[16, 32, 48], decode_rows=[1, 4], decode_context=[48],
                                      field_prefix="")

    def prefills(order) -> list[int]:
        return [s.tokens for s in order if s.kind == "prefill"]

    assert prefills(compiling.compile_order(buckets)) == [48, 16, 32]  # the ready one, then shortest first
    record(fresh_cache, "llm-order", "prefill", {10: 1, 30: 9})
    with caplog.at_level(logging.INFO, logger="neuron_serve"):
        build = GenerationBuild(gm.build("llama"), buckets, name="llm-order")
    assert "model llm-order: compile order for the 10 prompt lengths recorded (16: 10%, 32: 90%, 48: 0%)" \
        in caplog.messages
    assert prefills(build.order) == [48, 32, 16]
    assert sorted(build.order, key=str) == sorted(compiling.compile_order(buckets), key=str)  # the same models
    build.compiles.cancel()
