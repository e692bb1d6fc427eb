"""Triton's model configuration and statistics extensions, and the NeuronCore metrics
under neuron-monitor's names, against a real server: tiny.yaml, 2 replicas x 2 cores."""

import json
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch
import tritonclient.http as triton
from prometheus_client.parser import text_string_to_metric_families
from tritonclient.utils import InferenceServerException

MODELS = Path(__file__).parent / "models"
sys.path.insert(0, str(MODELS))
import tiny_mlp  # noqa: E402

ROWS = 4  # tiny.yaml's trace batch; it is compiled at 1, 4 and 16 (the default for max_batch_size 16)


@pytest.fixture(scope="module")
def tiny(server_factory, tmp_path_factory):
    # Serve's own proxy, not HAProxy: with another HAProxy-ingress server up on the machine
    # (the session's), requests to one server's port were seen answered by the other's
    # server app, and these tests assert server-wide figures (the model list, counters).
    srv = server_factory([str(MODELS / "tiny.yaml")], tmp_path_factory.mktemp("tiny"), args=("--ingress", "proxy"))
    # Each model compiled in the background is timed on a core as it joins: executions the counting tests would
    # take for the requests'. They count from here.
    srv.wait_compiled()
    yield srv
    srv.stop()


def client(server):
    return triton.InferenceServerClient(server.url.removeprefix("http://"), concurrency=16)


def infer(c, rows=ROWS, features=16):
    x = triton.InferInput("x", [rows, features], "FP32")
    data = np.random.rand(rows, features).astype("float32")
    x.set_data_from_numpy(data)
    return data, c.infer("tiny", [x]).as_numpy("output_0")


def scrape(server) -> dict[str, list]:
    with urllib.request.urlopen(server.url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    found: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found.setdefault(sample.name, []).append(sample)
    return found


def total(samples, **labels) -> float:
    return sum(s.value for s in samples if all(s.labels.get(k) == v for k, v in labels.items()))


def test_model_config_in_tritons_schema(tiny):
    config = client(tiny).get_model_config("tiny")
    assert config["name"] == "tiny" and config["max_batch_size"] == 16
    assert config["input"] == [{"name": "x", "data_type": "TYPE_FP32", "dims": [16]}]
    assert config["output"] == [{"name": "output_0", "data_type": "TYPE_FP32", "dims": [4]}]
    batching = config["dynamic_batching"]
    assert batching["max_queue_delay_microseconds"] == 2000 and batching["preferred_batch_size"] == [1, 4, 16]
    assert batching["default_queue_policy"] == {
        "timeout_action": "REJECT", "default_timeout_microseconds": 30_000_000,
        "allow_timeout_override": False, "max_queue_size": 64,
    }
    assert [(g["kind"], g["count"]) for g in config["instance_group"]] == [("KIND_MODEL", 4)]  # 2 replicas x 2 cores
    assert config["parameters"]["emulated"] == {"string_value": "true"}
    with urllib.request.urlopen(tiny.url + "/v2", timeout=30) as r:
        assert {"binary_tensor_data", "model_configuration", "statistics"} <= set(json.load(r)["extensions"])


def test_unknown_model_config_and_stats_are_404(tiny):
    c = client(tiny)
    for call in (c.get_model_config, c.get_inference_statistics):
        with pytest.raises(InferenceServerException) as err:
            call("nope")
        assert err.value.status() == "404" and "model 'nope' not found" in err.value.message()


def test_statistics_count_exactly_the_requests_sent(tiny):
    c = client(tiny)
    before = c.get_inference_statistics("tiny")["model_stats"][0]
    started_ms = time.time() * 1000
    model = tiny_mlp.build()
    for _ in range(6):
        data, out = infer(c)
        np.testing.assert_allclose(out, model(torch.from_numpy(data)).detach().numpy(), rtol=1e-5, atol=1e-5)
    for _ in range(2):  # a wrong feature count: refused with 400, counted as failures
        with pytest.raises(InferenceServerException):
            infer(c, features=15)
    after = c.get_inference_statistics("tiny")["model_stats"][0]
    assert after["name"] == "tiny" and after["version"] == "1"
    stats, prior = after["inference_stats"], before["inference_stats"]
    assert stats["success"]["count"] - prior["success"]["count"] == 6
    assert stats["fail"]["count"] - prior["fail"]["count"] == 2
    for stage in ("queue", "compute_input", "compute_infer", "compute_output"):
        assert stats[stage]["count"] - prior[stage]["count"] == 6, stage
        assert stats[stage]["ns"] > prior[stage]["ns"], stage
    # Each stage is part of the request's whole time.
    gained = {k: stats[k]["ns"] - prior[k]["ns"] for k in stats}
    assert gained["compute_infer"] < gained["success"] and gained["queue"] < gained["success"]
    assert after["inference_count"] - before["inference_count"] == 6 * ROWS
    assert after["execution_count"] - before["execution_count"] == 6  # sent one at a time: a batch each
    assert after["last_inference"] >= started_ms - 1
    everything = c.get_inference_statistics()["model_stats"]  # GET /v2/models/stats
    assert [s["name"] for s in everything] == ["tiny"]
    assert everything[0]["inference_stats"]["success"]["count"] >= stats["success"]["count"]


def accelerator_partitions(tiny) -> int:
    parts = client(tiny).get_model_metadata("tiny")["parameters"]["partitions"]
    return sum(p["device"] != "cpu" for p in parts)


def test_execution_status_counts_every_core_execution(tiny):
    c = client(tiny)
    per_request = accelerator_partitions(tiny)
    assert per_request == 1
    infer(c)
    time.sleep(1.5)  # one monitor period: the warm-up request is published
    before = total(scrape(tiny).get("execution_status_total", []), model="tiny", status_type="completed")
    for _ in range(8):
        infer(c)
    deadline, counted = time.monotonic() + 10, None
    while time.monotonic() < deadline:
        counted = total(scrape(tiny)["execution_status_total"], model="tiny", status_type="completed") - before
        if counted >= 8 * per_request:
            break
        time.sleep(0.5)
    assert counted == 8 * per_request
    assert total(scrape(tiny).get("execution_status_total", []), model="tiny", status_type="completed_with_err") == 0


def test_neuroncore_utilization_under_load(tiny):
    stop = time.monotonic() + 6
    seen: list[dict[tuple, float]] = []

    def load():
        c = client(tiny)  # tritonclient.http's gevent clients stay on one thread
        while time.monotonic() < stop:
            infer(c)

    with ThreadPoolExecutor(16) as pool:
        workers = [pool.submit(load) for _ in range(16)]
        time.sleep(2.5)  # past two monitor periods under load
        while time.monotonic() < stop - 0.5:
            samples = scrape(tiny)["neuroncore_utilization_ratio"]
            seen.append({(s.labels["replica"], s.labels["neuroncore"]): s.value
                         for s in samples if s.labels["model"] == "tiny"})
            time.sleep(0.7)
        for w in workers:
            w.result()
    labels = scrape(tiny)["neuroncore_utilization_ratio"][0].labels
    assert labels["emulated"] == "true" and labels["runtime_tag"].isdigit()
    assert all(len(s) == 4 and {core for _, core in s} == {"0", "1"} for s in seen), seen  # 2 replicas x 2 cores
    assert all(0 <= v <= 1 for s in seen for v in s.values()), seen
    assert any(all(v > 0 for v in s.values()) for s in seen), seen
    latency = {s.labels["percentile"]: s.value
               for s in scrape(tiny)["execution_latency_seconds"] if s.labels["model"] == "tiny"}
    assert set(latency) == {"p0", "p1", "p25", "p50", "p75", "p99", "p100"}
    assert 0 < latency["p0"] <= latency["p50"] <= latency["p100"]
