"""The Helm chart's Grafana dashboard against a real Prometheus (Debian's `prometheus`
package, which `make test` installs) scraping a real server under load: every query of
every panel returns data."""

import json
import re
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as triton

from conftest import free_port

DASHBOARD = Path(__file__).resolve().parents[2] / "helm" / "neuron-serve" / "dashboards" / "neuron-serve.json"
# What Grafana substitutes for the dashboard's variables: a rate window of several 1 s
# scrapes, and every model.
VARIABLES = {"$__rate_interval": "30s", "$model": ".*"}


@pytest.fixture(scope="module")
def prometheus(server, tmp_path_factory):
    """Prometheus on loopback scraping the server's /metrics every second; its base URL."""
    binary = shutil.which("prometheus") or "/usr/bin/prometheus"
    if not Path(binary).exists():
        pytest.fail("Prometheus is missing: apt-get install prometheus (Debian's package; make test installs it)")
    tmp = tmp_path_factory.mktemp("prometheus")
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "scrape_configs": [{"job_name": "neuron-serve", "metrics_path": "/metrics",
                            "static_configs": [{"targets": [f"127.0.0.1:{server.port}"]}]}],
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
        for target in panel["targets"]:
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


def test_every_panel_query_returns_data_under_load(server, prometheus):
    queries = panel_queries()
    assert len(queries) >= 12 and len({re.sub(r"\s+", "", e) for _, e in queries}) == len(queries)
    load(server, 8)
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
