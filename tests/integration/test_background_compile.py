"""A real deploy that is ready on its first compiled model and compiles the rest in the background:
two replicas starting together against one empty compile cache, one shape bucket that fails to
compile. What a client starting on readiness' first 200 gets, what deploy prints, what metrics and
`neuron-serve status` count, and that each compile-cache entry was computed once."""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import tritonclient.grpc as tgrpc

from conftest import ROOT, first_calls

# Apart from the parallel tests (make test's serial part): under their load, the client starting on readiness'
# first 200 has seen server-level gRPC calls answered UNAVAILABLE (HAProxy's server-app gRPC backend with no
# server up for a moment), as tests/integration/test_grpc_two_models.py's first-200 check has.
pytestmark = pytest.mark.serial

MODELS = ROOT / "tests" / "unit" / "models"  # per_position.py: the same answer whichever bucket runs it
TOLERANCE = 1e-5  # float32, the same operators compiled by XLA:CPU
WIDTH = 8
CONFIG = f"""
name: staged
model:
  factory: per_position:build
  kwargs: {{width: {WIDTH}, fail_at: 8}}   # bucket 2 (8 positions) fails to compile
inputs:
  - name: x
    shape: [4, 16, {WIDTH}]
partitioner: {{model_support_percentage_threshold: 0.5}}
buckets: {{sizes: [4, 8, 16], inputs: {{x: 1}}, outputs: {{output_0: 1}}}}
batch_sizes: [1, 4]
replicas: 2
batching: {{max_batch_size: 4, max_queue_delay_ms: 1}}
"""


@pytest.fixture(scope="module")
def staged(server_factory, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("staged")
    shutil.copy(MODELS / "per_position.py", tmp)
    (tmp / "staged.yaml").write_text(CONFIG)
    cache = tmp / "cache"  # empty: both replicas start cold, together
    srv = server_factory([str(tmp / "staged.yaml")], tmp, env={"NEURON_SERVE_CACHE_DIR": str(cache)},
                         at_first_200=first_calls(["staged"], ("staged", "x", [1, 16, WIDTH])))
    srv.cache = cache
    yield srv
    srv.stop()


def _series(server, name: str) -> list[tuple[dict, float]]:
    import urllib.request  # noqa: PLC0415

    with urllib.request.urlopen(server.url + "/metrics", timeout=10) as answer:
        text = answer.read().decode()
    found = []
    for labels, value in re.findall(rf"^{name}\{{([^}}]*)\}} (\S+)$", text, re.MULTILINE):
        found.append((dict(re.findall(r'(\w+)="([^"]*)"', labels)), float(value)))
    return found


def test_a_client_starting_on_the_first_ready_200_gets_answers(staged):
    assert staged.first_200_calls == {
        "grpc server live": True, "grpc server ready": True, "grpc staged ready": True,
        "grpc nope ready": "StatusCode.NOT_FOUND: model 'nope' not found", "grpc staged infer": [1, 16, WIDTH],
        "http /v2/health/ready": 200, "http /v2/models/staged": 200, "http /metrics": 200}


def test_each_replica_is_ready_on_one_model_and_names_the_background_compile_that_failed(staged):
    prefix = r"^\(ServeReplica:staged:model pid=\d+\) neuron_serve: "
    reason = "no kernel for sequences of length 8"
    # Ray folds alike lines of several replicas ("[repeated 2x across cluster]") and holds some back
    # for seconds: each line is looked for once, from either replica.
    finished = prefix + r"model staged: background compile finished [\d.]+ s after the build began: 4 compiled models, 2 failed"
    log = staged.output(finished, prefix + "compile of staged bucket 2 batch [14] failed after")
    assert re.search(prefix + r"compiled staged bucket 3 batch 4 \(1 of 6\) in [\d.]+ s$", log, re.MULTILINE)
    built = re.search(prefix + r"model staged built in [\d.]+s; ready on 1 of 6 compiled models, the other 5 compile in "
                               r"the background$", log, re.MULTILINE)
    assert built and built.start() < log.index("serving staged on http://")  # deploy's ready line after it
    failed = re.search(prefix + r"compile of staged bucket 2 batch [14] failed after [\d.]+ s: (.*)$", log, re.MULTILINE)
    assert reason in failed.group(1)
    summary = re.search(finished + "(.*)$", log, re.MULTILINE).group(1)
    assert summary.startswith("; staged bucket 2 batch 4 failed: ") and "; staged bucket 2 batch 1 failed: " in summary
    assert summary.count(reason) == 2


def test_metrics_and_status_count_each_replicas_compiled_and_failed_models(staged):
    states = {}
    for labels, value in _series(staged, "neuron_serve_compiled_models"):
        if labels["model"] == "staged":
            states.setdefault(labels["replica"], {})[labels["state"]] = value
    assert list(states.values()) == [{"compiled": 4, "pending": 0, "failed": 2}] * 2
    buckets = {labels["bucket"] for labels, _ in _series(staged, "neuron_serve_compile_seconds")
               if labels["model"] == "staged"}
    assert buckets == {f"bucket {b} batch {n}" for b in (1, 3) for n in (1, 4)}
    status = subprocess.run([sys.executable, "-m", "neuron_serve.cli", "status", "--address", staged.ray_address()],
                            cwd=ROOT, capture_output=True, text=True, timeout=120,
                            env={**os.environ, "PYTHONPATH": str(ROOT), "PYTHONWARNINGS": "ignore"})
    assert status.returncode == 0, status.stderr[-2000:]
    compiled = json.loads(status.stdout)["staged"]["compile"]
    assert {k: compiled[k] for k in ("compiled", "pending", "failed")} == {"compiled": 8, "pending": 0, "failed": 4}
    assert len(compiled["replicas"]) == 2
    for replica in compiled["replicas"].values():
        assert sorted(f["model"] for f in replica["failures"]) == ["staged bucket 2 batch 1", "staged bucket 2 batch 4"]


def test_answers_equal_eager_whichever_bucket_serves_them(staged):
    sys.path.insert(0, str(MODELS))
    import per_position  # noqa: PLC0415

    eager = per_position.build(WIDTH)  # no failing length: the reference answers every length
    client = tgrpc.InferenceServerClient(staged.grpc_url)
    try:
        for length in (3, 4, 5, 8, 13, 16):  # bucket 1; bucket 2's lengths, on bucket 3; bucket 3
            x = torch.rand(3, length, WIDTH)
            data = tgrpc.InferInput("x", list(x.shape), "FP32")
            data.set_data_from_numpy(x.numpy())
            out = client.infer("staged", [data]).as_numpy("output_0")
            torch.testing.assert_close(torch.from_numpy(np.array(out)), eager(x).detach(), atol=TOLERANCE,
                                       rtol=TOLERANCE)
    finally:
        client.close()


def test_two_replicas_starting_together_compute_each_cache_entry_once(staged):
    """Each operator-support decision (a torch-xla compile) is computed by one replica and read by the
    other: their cache hits add up to the entries in the cache, once each."""
    entries = len(list((Path(staged.cache) / "support").rglob("*.json")))
    hits = [value for labels, value in _series(staged, "neuron_serve_compile_cache_hits_total")
            if labels["model"] == "staged" and labels["cache"] == "support"]
    assert entries > 0 and len(hits) == 2 and sum(hits) == entries
