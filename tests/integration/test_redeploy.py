"""Redeploying a changed model.yaml into a running server under load drops nothing.

`neuron-serve deploy --address <ray> model.yaml` with a model already served updates it
in place: Ray Serve builds the new replicas while the old ones serve, routes to the new
ones, then drains the old ones. Clients that honour Retry-After see only answers.
"""

import http.client
import json
import shutil
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import pytest
import yaml

from conftest import ROOT, Server
from http_client import Client, infer_body

pytestmark = pytest.mark.serial  # make test runs it apart: it times a redeploy under load

MODEL = "faulty"
MODELS = Path(__file__).parent / "models"
NEW_MAX_BATCH = 2  # faulty.yaml's is 4


def changed_config(tmp: Path) -> Path:
    """faulty.yaml with another batching.max_batch_size, beside its own copy of faulty.py."""
    config = yaml.safe_load((MODELS / "faulty.yaml").read_text())
    assert config["batching"]["max_batch_size"] != NEW_MAX_BATCH
    config["batching"]["max_batch_size"] = NEW_MAX_BATCH
    shutil.copy(MODELS / "faulty.py", tmp / "faulty.py")
    (path := tmp / "faulty.yaml").write_text(yaml.safe_dump(config))
    return path


def max_batch_size(client: Client) -> int | str:
    """What the replica answering says (Triton's model configuration endpoint)."""
    answer = client.request("GET", f"/v2/models/{MODEL}/config")
    return answer.json()["max_batch_size"] if answer.status == 200 else f"{answer.status}: {answer.body[:60]!r}"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = Server([str(MODELS / "faulty.yaml")], tmp_path_factory.mktemp("redeploy"))
    # Ready answers once the server app runs; deploy logs where its Ray is a moment later.
    deadline = time.monotonic() + 60
    while "serving faulty" not in srv.log.read_text(errors="replace") and time.monotonic() < deadline:
        time.sleep(0.2)
    yield srv
    srv.stop()


def test_redeploy_of_a_changed_model_yaml_under_load_drops_nothing(server, tmp_path):
    probe = Client(server.url, keep_alive=False)
    assert max_batch_size(probe) == 4
    config = changed_config(tmp_path)
    # Half the clients open a connection per request, half keep theirs open across the
    # switch (a keep-alive connection HAProxy accepted before it was reconfigured).
    clients = [Client(server.url, timeout=60, keep_alive=worker % 2 == 0) for worker in range(4)]
    results: list[tuple[float, float, str]] = []
    stop = threading.Event()

    def loop(worker: int) -> None:
        while not stop.is_set():
            started = time.monotonic()
            try:
                answer = clients[worker].infer(MODEL, infer_body([[0.1 * worker] * 8]))
            except (OSError, http.client.HTTPException) as exc:
                results.append((started, time.monotonic() - started, f"dropped: {type(exc).__name__}"))
                continue
            kind = str(answer.status)
            if answer.status != 200:
                assert answer.headers.get("content-type") == "application/json", answer.body
                kind += f" Retry-After: {answer.headers.get('retry-after')} {json.loads(answer.body)['error'][:60]}"
            results.append((started, time.monotonic() - started, kind))
            time.sleep(float(answer.headers.get("retry-after") or 0))

    threads = [threading.Thread(target=loop, args=(i,), daemon=True) for i in range(4)]
    for t in threads:
        t.start()
    try:
        time.sleep(1.0)
        began = time.monotonic()
        done = subprocess.run([sys.executable, "-m", "neuron_serve.cli", "deploy", str(config), "--address",
                               server.ray_address(), "--port", str(server.port), "--grpc-port",
                               str(server.grpc_port)], cwd=ROOT, capture_output=True, text=True, timeout=600)
        took = time.monotonic() - began
        # Right after the redeploy returns, every answer comes from a new replica.
        after = [max_batch_size(probe) for _ in range(10)]
        time.sleep(4.0)  # load on while the old replicas drain and stop
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=60)
        for client in clients:
            client.close()
    outcomes = Counter(kind for _, _, kind in results)
    during = Counter(kind for start, _, kind in results if start > began)
    print(f"\nredeploy under load: {took:.1f} s; {dict(outcomes)}; after it: max_batch_size {set(after)}")
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"{MODEL}: ready" in done.stderr
    assert after == [NEW_MAX_BATCH] * 10
    assert not [k for k in outcomes if k.startswith("dropped") or k.startswith("5") and not k.startswith("503")], outcomes
    # Only the queue-full 503 of a busy replica, or HAProxy's own, both with Retry-After.
    assert all(k == "200" or "Retry-After: 1" in k for k in outcomes), outcomes
    assert during["200"] > 0 and outcomes["200"] > 0.9 * sum(outcomes.values()), outcomes
    # The server app kept running: health, metrics and gRPC answer as before.
    assert probe.request("GET", "/v2/health/ready").status == 200
    probe.close()
