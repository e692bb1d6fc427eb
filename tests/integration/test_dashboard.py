"""The Helm chart's Grafana dashboard against a real Prometheus (Debian's `prometheus`
package, which `make test` installs) scraping two real servers under load: the shared one
(mlp and encoder, for the serving panels) and the shared task: generate one (the LLM
example, for the Generation row). Every query of every panel returns data."""

import json
import re
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import openai
import pytest
import tritonclient.http as triton

from conftest import free_port

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "helm" / "neuron-serve" / "dashboards" / "neuron-serve.json"
# What Grafana substitutes for the dashboard's variables: a rate window of several 1 s
# scrapes, and every model.
VARIABLES = {"$__rate_interval": "30s", "$model": ".*"}


LLM = "llm"  # the shared generate server (conftest.llm)


@pytest.fixture(scope="module")
def prometheus(server, llm, tmp_path_factory):
    """Prometheus on loopback scraping both servers' /metrics every second; its base URL."""
    binary = shutil.which("prometheus") or "/usr/bin/prometheus"
    if not Path(binary).exists():
        pytest.fail("Prometheus is missing: apt-get install prometheus (Debian's package; make test installs it)")
    tmp = tmp_path_factory.mktemp("prometheus")
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "scrape_configs": [{"job_name": "neuron-serve", "metrics_path": "/metrics",
                            "static_configs": [{"targets": [f"127.0.0.1:{server.port}", f"127.0.0.1:{llm.port}"]}]}],
    }
    (tmp / "prometheus.yml").write_text(json.dumps(config))  # YAML is a superset of JSON
    port = free_port()
    with (tmp / "prometheus.log").open("wb") as log:
        proc = subprocess.Popen(
            [binary, f"--config.file={tmp / 'prometheus.yml'}", f"--storage.tsdb.path={tmp / 'data'}",
             f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
            stdout=log, stderr=subprocess.STDOUT,
        )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            with urllib.request.urlopen(url + "/-/ready", timeout=2) as r:
                if r.status == 200:
                    break
        except OSError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"Prometheus did not start:\n{(tmp / 'prometheus.log').read_text()[-2000:]}")
        time.sleep(0.5)
    yield url
    proc.terminate()
    proc.wait(timeout=30)


def panel_queries() -> list[tuple[str, str]]:
    dashboard = json.loads(DASHBOARD.read_text())
    queries = []
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):  # a row has none
            expr = target["expr"]
            for name, value in VARIABLES.items():
                expr = expr.replace(name, value)
            assert "$" not in expr, expr  # every variable the dashboard uses is substituted
            queries.append((f"{panel['title']} / {target['refId']}", expr))
    return queries


def query(prometheus: str, expr: str) -> list[dict]:
    with urllib.request.urlopen(f"{prometheus}/api/v1/query?{urllib.parse.urlencode({'query': expr})}",
                                timeout=30) as r:
        answer = json.load(r)
    assert answer["status"] == "success", answer
    return answer["data"]["result"]


def has_data(result: list[dict]) -> bool:
    return any(np.isfinite(float(series["value"][1])) for series in result)


def load(server, seconds: float) -> None:
    stop = time.monotonic() + seconds

    def worker():
        client = triton.InferenceServerClient(server.url.removeprefix("http://"))
        while time.monotonic() < stop:
            x = triton.InferInput("x", [3, 784], "FP32")  # 3 rows: batches are padded to the trace batch
            x.set_data_from_numpy(np.random.rand(3, 784).astype("float32"))
            client.infer("mlp", [x])

    with ThreadPoolExecutor(8) as pool:
        for done in [pool.submit(worker) for _ in range(8)]:
            done.result()


def generate_load(llm, seconds: float, streams: int = 4) -> int:
    """Streamed /v1/completions of 200 tokens each (EOS ignored) on ``streams`` connections
    until ``seconds`` have passed, and one request whose client leaves mid-stream (an
    abort); the number of completed requests."""
    stop = time.monotonic() + seconds

    def worker(i: int) -> int:
        done = 0
        with openai.OpenAI(base_url=f"{llm.url}/v1", api_key="unused", max_retries=0, timeout=300) as client:
            while time.monotonic() < stop:
                chunks = list(client.completions.create(
                    model=LLM, prompt=f"Request {i}.{done} to the cores:", max_tokens=200, temperature=0,
                    stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
                assert chunks[-1].usage.completion_tokens == 200, chunks[-1]
                assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
                done += 1
        return done

    def leave_mid_stream() -> None:
        body = json.dumps({"model": LLM, "prompt": "Hi", "max_tokens": 250, "ignore_eos": True,
                           "stream": True}).encode()
        with socket.create_connection(("127.0.0.1", llm.port), timeout=60) as conn:
            conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n" % len(body) + body)
            assert conn.recv(100).startswith(b"HTTP/1.1 200")  # streaming: then the client is gone

    with ThreadPoolExecutor(streams + 1) as pool:
        workers = [pool.submit(worker, i) for i in range(streams)]
        time.sleep(1)  # the abort among running sequences
        pool.submit(leave_mid_stream).result()
        return sum(w.result() for w in workers)


def test_every_panel_query_returns_data_under_load(server, llm, prometheus):
    queries = panel_queries()
    assert len(queries) >= 27 and len({re.sub(r"\s+", "", e) for _, e in queries}) == len(queries)
    with ThreadPoolExecutor(2) as pool:  # both servers under load at once: one rate window holds both
        serving = pool.submit(load, server, 8)
        generated = pool.submit(generate_load, llm, 8)
        serving.result()
        assert generated.result() >= 4
    deadline, missing = time.monotonic() + 30, queries
    while missing and time.monotonic() < deadline:
        missing = [(title, expr) for title, expr in missing if not has_data(query(prometheus, expr))]
        if missing:
            time.sleep(1)
    assert not missing, "panels without data:\n" + "\n".join(f"{t}: {e}" for t, e in missing)
    # The per-core panel shows each of mlp's 2 cores, busy under that load.
    cores = query(prometheus, 'max_over_time(neuroncore_utilization_ratio{model="mlp"}[30s])')
    assert sorted(s["metric"]["neuroncore"] for s in cores) == ["0", "1"]
    assert all(0 < float(s["value"][1]) <= 1 for s in cores), cores
    # The Generation row shows the LLM's load: its sequences held slots, and its requests
    # finished by length and by abort (the client that left).
    assert LLM in {s["metric"]["model"] for s in query(prometheus, "count by (model) (neuron_serve_requests_total)")}
    # Generation metrics name the model in vLLM's label, model_name.
    for gauge in ("neuron_serve_num_requests_running", "neuron_serve_kv_cache_usage_perc"):
        peak = query(prometheus, f'max_over_time({gauge}{{model_name="{LLM}"}}[1m])')  # a series a replica
        assert peak and max(float(s["value"][1]) for s in peak) > 0, (gauge, peak)
    reasons = query(prometheus, f'sum by (finished_reason) (neuron_serve_request_success_total{{model_name="{LLM}"}})')
    assert {"length", "abort"} <= {s["metric"]["finished_reason"] for s in reasons}, reasons
