"""Where rows went: chunks per core (one per chunk), chunks per compiled size, padded rows."""

import asyncio
import json
from pathlib import Path

import pytest
import torch

from neuron_serve import metrics
from neuron_serve.assembly.from_config import build
from neuron_serve.config.factory import build_model
from neuron_serve.config.schema import parse_config
from neuron_serve.serve.infer.http import infer as rest_infer
from neuron_serve.serve.infer.plane import ModelDataPlane

HERE = Path(__file__).resolve().parents[2] / "models"  # two_stage_model.py

TOLERANCE = 1e-5
LABELS = {"model": "two-stage", "replica": "chunk-metrics"}
CONFIG = {
    "name": "two-stage", "model": {"factory": "two_stage_model:build"}, "inputs": [{"name": "x", "shape": [4, 8]}],
    "partitioner": {"model_support_percentage_threshold": 0.5}, "batch_sizes": [2, 8],
    "batching": {"max_batch_size": 8, "max_queue_delay_ms": 1},
}


@pytest.fixture(scope="module")
def two_stage():
    config = parse_config(CONFIG)
    return config, build(config, HERE), build_model(config, HERE)


def body(x: torch.Tensor) -> bytes:
    return json.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": list(x.shape),
                                   "data": x.flatten().tolist()}]}).encode()


def counts() -> dict:
    return {
        "core": metrics.CORE_BATCHES.labels(**LABELS, core="0")._value.get(),
        "size 2": metrics.SIZE_CHUNKS.labels(**LABELS, batch_size="2")._value.get(),
        "size 8": metrics.SIZE_CHUNKS.labels(**LABELS, batch_size="8")._value.get(),
        "padding": metrics.PADDING_ROWS.labels(**LABELS)._value.get(),
        "batch padding": metrics.BATCH_PADDING.labels(**LABELS)._sum.get(),
    }


def test_a_chunk_through_two_accelerator_partitions_counts_once_and_padding_is_counted(two_stage):
    config, built, eager = two_stage
    assert [p.device for p in built.first.partitions] == ["neuron", "cpu", "neuron"]
    assert built.batch_sizes == [2, 8]

    async def calls():
        plane = ModelDataPlane(config, built, replica=LABELS["replica"])
        # Given costs, so the plan is known: 3 rows run as 2 + 2 (2.0 < 3.0), 7 rows as one 8 (3.0 < 4.0).
        plane.runner.use_costs([{2: 1.0, 8: 3.0}])
        plane.start()
        try:
            before = counts()
            outputs = []
            for rows in (3, 7):
                x = torch.rand(rows, 8)
                content, _ = await rest_infer(plane, body(x), {})
                out = torch.tensor(json.loads(content)["outputs"][0]["data"]).reshape(rows, 4)
                outputs.append((out, eager(x)))
            await asyncio.sleep(0)  # metrics are applied on the loop's next turn, after the answer
            return before, counts(), outputs
        finally:
            await plane.stop()

    before, after, outputs = asyncio.run(calls())
    for out, expected in outputs:
        torch.testing.assert_close(out, expected, atol=TOLERANCE, rtol=TOLERANCE)
    delta = {k: after[k] - before[k] for k in after}
    # Three chunks (2, 2 and 8 rows), each through both accelerator partitions: three, not six.
    assert delta == {"core": 3, "size 2": 2, "size 8": 1, "padding": 2, "batch padding": 2}


BUCKETED = {
    "name": "row-sums", "model": {"factory": "two_stage_model:row_sums"}, "inputs": [{"name": "x", "shape": [2, 8]}],
    "buckets": {"sizes": [4, 8], "inputs": {"x": 1}}, "batch_sizes": [2, 4],
    "batching": {"max_batch_size": 4, "max_queue_delay_ms": 500},
}


def test_each_shape_bucket_pads_its_own_rows_and_the_padding_is_counted():
    config = parse_config(BUCKETED)
    built, eager = build(config, HERE), build_model(config, HERE)
    labels = {"model": "row-sums", "replica": "chunk-metrics"}
    assert built.batch_sizes == [2, 4] and len(built.buckets) == 2

    def padding():
        return metrics.PADDING_ROWS.labels(**labels)._value.get(), metrics.BATCH_PADDING.labels(**labels)._sum.get()

    async def calls():
        plane = ModelDataPlane(config, built, replica=labels["replica"])
        plane.runner.use_costs([{2: 1.0, 4: 3.0}, {2: 1.0, 4: 3.0}])
        plane.start()
        try:
            before = padding()
            short, long = torch.rand(1, 3), torch.rand(1, 6)  # one row for each shape bucket, in one batch
            replies = await asyncio.gather(rest_infer(plane, body(short), {}), rest_infer(plane, body(long), {}))
            outs = [torch.tensor(json.loads(c)["outputs"][0]["data"]).reshape(1, 2) for c, _ in replies]
            await asyncio.sleep(0)  # metrics are applied on the loop's next turn, after the answer
            return before, padding(), list(zip(outs, (eager(short), eager(long)))), dict(plane.runner.chunks)
        finally:
            await plane.stop()

    before, after, outputs, chunks = asyncio.run(calls())
    for out, expected in outputs:
        torch.testing.assert_close(out, expected, atol=TOLERANCE, rtol=TOLERANCE)
    assert chunks == {(0, 2): 1, (1, 2): 1}  # each bucket's one row ran padded to 2
    # Two rows in the batch, but each shape bucket padded its one row to a 2-row chunk.
    assert (after[0] - before[0], after[1] - before[1]) == (2, 2)


def test_an_infer_model_counts_and_keeps_its_sizes_and_neuron_serve_buckets_proposes_from_them(
        fresh_cache, tmp_path, capsys):
    """A task: infer model's two families, as a replica records them: each request's size along its bucketed dim
    against the shape bucket that ran it (``shape``), each chunk's real rows against its compiled batch size
    (``rows``); in its metadata, its Prometheus counters and, when it stops, the compile cache, where `neuron-serve
    buckets` reads them."""
    from prometheus_client import REGISTRY

    from neuron_serve import cli

    config = parse_config({**BUCKETED, "name": "row-sums-usage"})
    built, eager = build(config, HERE), build_model(config, HERE)
    replica = "usage"

    def work(family: str, bucket: int, kind: str) -> float:
        return REGISTRY.get_sample_value("neuron_serve_bucket_work_total", {
            "model": "row-sums-usage", "replica": replica, "family": family, "bucket": str(bucket),
            "kind": kind}) or 0.0

    async def calls():
        plane = ModelDataPlane(config, built, replica=replica, record_sizes=True)
        plane.runner.use_costs([{2: 1.0, 4: 3.0}, {2: 1.0, 4: 3.0}])
        plane.start()
        try:
            outs = []
            for length in (3, 3, 6):  # one row each, one at a time: three 2-row chunks
                x = torch.rand(1, length)
                content, _ = await rest_infer(plane, body(x), {})
                outs.append((torch.tensor(json.loads(content)["outputs"][0]["data"]).reshape(1, 2), eager(x)))
            await asyncio.sleep(0)  # metrics are applied on the loop's next turn, after the answer
            return outs, plane.metadata()["parameters"]["padding"]
        finally:
            await plane.stop()

    outputs, padding = asyncio.run(calls())
    for out, expected in outputs:
        torch.testing.assert_close(out, expected, atol=TOLERANCE, rtol=TOLERANCE)
    # Lengths 3, 3 (bucket 4: 1 padded each) and 6 (bucket 8: 2 padded); each row alone in a chunk of 2.
    assert padding == {
        "rows": {"padded_fraction": 0.5, "buckets": {"2": {"calls": 3, "real": 3, "padded": 3}}},
        "shape": {"padded_fraction": round(4 / 16, 4), "buckets": {"4": {"calls": 2, "real": 6, "padded": 2},
                                                                    "8": {"calls": 1, "real": 6, "padded": 2}}}}
    assert (work("shape", 4, "real"), work("shape", 4, "padded"), work("shape", 8, "padded")) == (6, 2, 2)
    assert (work("rows", 2, "real"), work("rows", 2, "padded")) == (3, 3)

    # Kept in the compile cache when the replica stopped; proposed from there.
    (yaml_path := tmp_path / "row-sums.yaml").write_text(json.dumps({**BUCKETED, "name": "row-sums-usage"}))
    assert cli.main(["buckets", str(yaml_path), "--min-calls", "1", "--json"]) == 0
    families = json.loads(capsys.readouterr().out)
    # shape: sizes {3: 2, 6: 1} on two buckets, 8 kept: [3, 8] pads 3+3+8 = 14 against [6, 8]'s 6+6+6 = 18.
    assert families["shape"]["today"] == [4, 8] and families["shape"]["proposed"] == [3, 8]
    assert families["shape"]["padding_today"] == pytest.approx(16 / 12)
    assert families["shape"]["padding_proposed"] == pytest.approx(14 / 12)
    # rows: every chunk had one real row: [1, 4] pads nothing.
    assert families["rows"]["today"] == [2, 4] and families["rows"]["proposed"] == [1, 4]
    assert families["rows"]["padding_proposed"] == pytest.approx(1.0)
    assert cli.main(["buckets", str(yaml_path), "--min-calls", "1"]) == 0
    assert capsys.readouterr().out.endswith("model.yaml:\nbatch_sizes: [1, 4]\nbuckets:\n  sizes: [3, 8]\n")


@pytest.mark.parametrize("after", [16, 17])
def test_batch_sizes_auto_starts_on_the_sizes_the_recorded_chunks_call_for(fresh_cache, caplog, after):
    """``batch_sizes: auto``: a replica starting with ``learn_buckets_after`` chunks recorded in the compile cache
    compiles as many batch sizes as the defaults (1, 4, 8 for max_batch_size 8), the largest kept, that pad them
    least; with fewer recorded, the defaults. Answers are eager's either way."""
    from neuron_serve.buckets import usage as bucket_usage

    name = f"row-sums-auto-{after}"
    config = parse_config({**BUCKETED, "name": name, "batch_sizes": "auto", "learn_buckets_after": after,
                           "batching": {"max_batch_size": 8, "max_queue_delay_ms": 1}})
    recorded = bucket_usage.Usage(name, "earlier", fresh_cache.root)  # another replica's chunks, kept when it stopped
    for rows, times in ((2, 10), (3, 5), (8, 1)):
        recorded.sizes.record("rows", rows, times)
    recorded.save()
    with caplog.at_level("INFO", logger="neuron_serve"):
        built = build(config, HERE)
    learned = after <= 16
    # 16 chunks of 2, 3 and 8 rows on three sizes with 8 kept: 2 and 3 pad nothing ([1, 4, 8] pads 10*2 + 5*1).
    assert built.batch_sizes == ([2, 3, 8] if learned else [1, 4, 8])
    line = (f"model {name}: batch sizes [2, 3, 8], learned from 16 recorded chunks: padded work 1.00x the real, "
            f"against 1.58x with the defaults [1, 4, 8]" if learned else
            f"model {name}: batch sizes [1, 4, 8], the defaults (auto: 16 recorded of the 17 it waits for)")
    assert line in caplog.messages
    eager = build_model(config, HERE)

    async def calls():
        plane = ModelDataPlane(config, built, replica="auto")
        plane.start()
        try:
            x = torch.rand(5, 6)
            content, _ = await rest_infer(plane, body(x), {})
            return torch.tensor(json.loads(content)["outputs"][0]["data"]).reshape(5, 2), eager(x)
        finally:
            await plane.stop()

    out, expected = asyncio.run(calls())
    torch.testing.assert_close(out, expected, atol=TOLERANCE, rtol=TOLERANCE)
