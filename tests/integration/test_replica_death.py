"""A replica killed mid-request: its clients get a JSON answer, and new requests go to a live one.

faulty.yaml serves two replicas; requests whose first value is faulty.STALL_MARK stay in
the model's CPU stage for faulty.STALL_S, so they are surely in flight when one replica is
SIGKILLed. Behind HAProxy (the default ingress) a request the dead replica held is sent
again to the live replica; one HAProxy cannot place gets its error page, which
neuron-serve makes JSON (Serve's is plain text).
"""

import json
import sys
import threading
import time
from pathlib import Path

import pytest

from conftest import Server
from http_client import Client, infer_body

sys.path.insert(0, str(Path(__file__).parent / "models"))
import faulty  # noqa: E402

pytestmark = pytest.mark.serial  # make test runs it apart: it times the recovery from a killed replica

MODEL = "faulty"
CONFIG = "tests/integration/models/faulty.yaml"
PAGE_ERROR = "no replica answered this request"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = Server([CONFIG], tmp_path_factory.mktemp("replica-death"))
    yield srv
    srv.stop()


def test_requests_on_a_killed_replica_get_json_and_new_ones_a_live_replica(server):
    client = Client(server.url, timeout=30, keep_alive=False)
    pids = server.replica_pids(MODEL)
    assert len(pids) == 2
    answers: list = []

    def stalled(worker: int) -> None:
        body = infer_body([[faulty.STALL_MARK] + [0.1 * worker] * 7])
        answers.append(client.infer(MODEL, body))

    threads = [threading.Thread(target=stalled, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    time.sleep(0.8)  # in the CPU stage on both replicas (STALL_S = 4 s)
    server.kill_pid(pids[0])
    for t in threads:
        t.join(timeout=60)
    statuses = [(a.status, a.headers.get("content-type"), a.body[:200]) for a in answers]
    print(f"\nin flight at the kill: {statuses}")
    assert len(answers) == 6
    # No connection is dropped and every answer is JSON: those the dead replica held are
    # sent again to the live one (HAProxy's retry-on empty-response), where, stalled
    # behind the live replica's own, they meet the model's 504 (request_timeout_s) or
    # succeed; HAProxy's page (503, Retry-After) answers any it could not place.
    assert all(a.headers.get("content-type") == "application/json" for a in answers), statuses
    failed = [a for a in answers if a.status != 200]
    assert all(isinstance(json.loads(a.body)["error"], str) for a in failed), statuses
    page = [a for a in failed if PAGE_ERROR in a.json()["error"]]
    assert all(a.status == 503 and a.headers.get("retry-after") == "1" for a in page), statuses
    assert {a.status for a in answers} <= {200, 503, 504}, statuses

    # Requests that reach no replica yet are sent to the live one (HAProxy retries a
    # refused connection on another server), while Ray restarts the dead one.
    time.sleep(2 * faulty.STALL_S)  # the live replica finishes the stalled batches first
    later = [client.infer(MODEL, infer_body([[0.5] * 8])) for _ in range(20)]
    assert [a.status for a in later] == [200] * 20, [(a.status, a.body[:200]) for a in later]
    client.close()
