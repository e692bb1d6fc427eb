"""Scale-out: on a two-node Ray cluster whose nodes advertise 2 ``neuron_cores`` each, two
replicas of 2 cores must land on different nodes, and both serve.

The cluster is ray.cluster_utils.Cluster on this machine (each node its own raylet);
the model is deployed through ``neuron-serve deploy --address``, as a user joins a cluster.
"""

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
MODELS = Path(__file__).with_name("models")
sys.path.insert(0, str(MODELS))
import tiny_mlp  # noqa: E402
from conftest import free_port  # noqa: E402

TOLERANCE = 1e-5  # XLA:CPU against eager float32, as in test_serving.py
NODE = {"num_cpus": 1, "resources": {"neuron_cores": 2}, "object_store_memory": 100 * 1024 * 1024}


@pytest.fixture(scope="module")
def cluster():
    """A head and a worker node, each with 1 CPU and 2 neuron_cores; removed afterwards."""
    from ray.cluster_utils import Cluster  # noqa: PLC0415

    # Cluster records its address in $RAY_TMPDIR/ray/ray_current_cluster, where a plain
    # ray.init() anywhere on this machine would find and join it: keep it private. Short,
    # because Ray's Unix socket paths live under it.
    tmpdir = tempfile.mkdtemp(prefix="nsc-", dir="/tmp")
    previous = os.environ.get("RAY_TMPDIR")
    os.environ["RAY_TMPDIR"] = tmpdir
    cluster = None
    try:
        cluster = Cluster(initialize_head=True, head_node_args={**NODE, "dashboard_port": free_port()})
        cluster.add_node(**NODE)
        cluster.wait_for_nodes()
        yield cluster
    finally:
        if cluster is not None:
            cluster.shutdown()
        if previous is None:
            os.environ.pop("RAY_TMPDIR", None)
        else:
            os.environ["RAY_TMPDIR"] = previous
        shutil.rmtree(tmpdir, ignore_errors=True)


def cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "neuron_serve.cli", *args], cwd=ROOT, env=env,
        capture_output=True, text=True, timeout=900,
    )


@pytest.fixture(scope="module")
def served(cluster, tmp_path_factory):
    """tiny.yaml deployed onto the cluster by `neuron-serve deploy --address`; its base URL."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PYTHONWARNINGS"] = "ignore"
    env["PROMETHEUS_MULTIPROC_DIR"] = str(tmp_path_factory.mktemp("metrics"))  # both nodes share this disk
    done = cli("deploy", str(MODELS / "tiny.yaml"), "--address", cluster.address, "--port", str(port),
               "--no-grpc", env=env)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "tiny: ready" in done.stderr
    yield f"http://127.0.0.1:{port}"
    cli("shutdown", "--address", cluster.address, env=env)


def test_each_replica_gets_its_own_node_and_neuron_cores(cluster, served):
    from ray.util.state import list_actors  # noqa: PLC0415

    actors = list_actors(address=cluster.address, filters=[("state", "=", "ALIVE")], detail=True, limit=10_000)
    replicas = [a for a in actors if a.class_name == "ServeReplica:tiny:model"]
    nodes = {cluster.head_node.node_id} | {n.node_id for n in cluster.worker_nodes}
    assert len(replicas) == 2
    assert {r.node_id for r in replicas} == nodes
    assert [r.required_resources.get("neuron_cores") for r in replicas] == [2, 2]


def _infer(url: str, x: torch.Tensor) -> tuple[int, torch.Tensor]:
    body = {"inputs": [{"name": "x", "shape": list(x.shape), "datatype": "FP32", "data": x.flatten().tolist()}]}
    req = urllib.request.Request(url + "/v2/models/tiny/infer", data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        out = json.loads(r.read())["outputs"][0]
        return r.status, torch.tensor(out["data"], dtype=torch.float32).reshape(out["shape"])


def _ok_by_replica(metrics_text: str) -> dict[str, float]:
    counts: dict[str, float] = {}
    for labels, value in re.findall(r"^neuron_serve_requests_total\{([^}]*)\} (\S+)$", metrics_text, re.M):
        fields = dict(kv.split("=", 1) for kv in labels.split(","))
        fields = {k: v.strip('"') for k, v in fields.items()}
        if fields["model"] == "tiny" and fields["code"] == "200":
            counts[fields["replica"]] = counts.get(fields["replica"], 0) + float(value)
    return counts


def test_both_replicas_serve_answers_equal_to_eager(served):
    model = tiny_mlp.build()
    rows = [torch.rand(1 + i % 5, 16) for i in range(64)]
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda x: _infer(served, x), rows))
    for x, (status, out) in zip(rows, answers):
        assert status == 200
        torch.testing.assert_close(out, model(x), atol=TOLERANCE, rtol=TOLERANCE)

    with urllib.request.urlopen(served + "/metrics", timeout=30) as r:
        by_replica = _ok_by_replica(r.read().decode())
    assert len(by_replica) == 2, by_replica  # each replica answered some of them
    assert sum(by_replica.values()) == len(rows)
