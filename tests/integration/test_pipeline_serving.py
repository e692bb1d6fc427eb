"""A model over an emulated core's memory, pipelined over two cores and served by `neuron-serve deploy`:
its stages, its answers against eager PyTorch, and which core ran which stage (from /metrics)."""

import json
import re
import sys
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

MODELS = Path(__file__).parent / "models"
sys.path.insert(0, str(MODELS))
import layers  # noqa: E402

TOLERANCE = 1e-5  # float32, the same operators compiled by XLA:CPU


@pytest.fixture(scope="module")
def served(server_factory, tmp_path_factory):
    srv = server_factory([str(MODELS / "pipelined.yaml")], tmp_path_factory.mktemp("pipelined"),
                         env={"NEURON_SERVE_CORE_MEMORY_BYTES": "40000"})
    yield srv
    srv.stop()


def infer(server, x: torch.Tensor) -> tuple[int, dict]:
    body = json.dumps({"inputs": [{"name": "x", "shape": list(x.shape), "datatype": "FP32",
                                   "data": x.flatten().tolist()}]}).encode()
    req = urllib.request.Request(server.url + "/v2/models/pipelined/infer", data=body, method="POST")
    with urllib.request.urlopen(req, timeout=60) as r:
        return r.status, json.loads(r.read())


def metric(server, name: str, **only: str) -> dict[tuple[str, str], float]:
    """(partition, core) -> value of ``name`` for the pipelined model (summed over other labels than ``only``)."""
    with urllib.request.urlopen(server.url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    found = {}
    for labels, value in re.findall(rf"^{name}\{{([^}}]*)\}} (\S+)$", text, re.MULTILINE):
        fields = dict(re.findall(r'(\w+)="([^"]*)"', labels))
        if fields.get("model") == "pipelined" and all(fields.get(k) == v for k, v in only.items()):
            key = (fields["partition"], fields["core"])
            found[key] = found.get(key, 0.0) + float(value)
    return found


def test_answers_equal_eager_for_any_rows(served):
    model = layers.build()
    xs = [torch.randn(rows, 64) for rows in (1, 3, 4, 9, 16, 2, 5, 8)]
    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda x: infer(served, x), xs))
    for x, (status, body) in zip(xs, answers):
        assert status == 200
        [out] = body["outputs"]
        assert out["shape"] == [x.shape[0], 64]
        with torch.no_grad():
            expected = model(x)
        torch.testing.assert_close(torch.tensor(out["data"]).reshape(out["shape"]), expected,
                                   rtol=TOLERANCE, atol=TOLERANCE)


def test_each_stage_ran_on_its_core_of_both_pipeline_copies(served):
    for rows in (4, 4, 4, 4, 1, 1):
        infer(served, torch.randn(rows, 64))
    runs = metric(served, "neuron_serve_partition_seconds_count")
    # Stage accel_0 on the first core of each copy (0, 2), accel_1 on the second (1, 3); nothing else ran.
    assert sorted(runs) == [("accel_0", "0"), ("accel_0", "2"), ("accel_1", "1"), ("accel_1", "3")]
    assert all(count > 0 for count in runs.values())


def test_stage_memory_and_bytes_crossing_into_each_stage(served):
    infer(served, torch.randn(4, 64))
    for size in ("1", "4"):  # compiled at batch 1 and 4: two stages each, each within the 40000-byte core
        memory = metric(served, "neuron_serve_stage_memory_bytes", batch_size=size)
        assert sorted(memory) == [("accel_0", "0"), ("accel_0", "2"), ("accel_1", "1"), ("accel_1", "3")]
        assert all(0 < size_bytes <= 40000 for size_bytes in memory.values())
    crossed = metric(served, "neuron_serve_stage_input_bytes_total")
    # Every stage run takes one float32 activation of 64 per row: a multiple of 256 bytes.
    assert sorted(crossed) == sorted(memory)
    assert all(size > 0 and size % 256 == 0 for size in crossed.values())
