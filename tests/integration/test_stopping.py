"""Stopping `neuron-serve deploy` is quick and says what it waits for; losing Ray's head ends it.

The bounds are the ones users are promised (README, "Faults and shutdown"): idle, deploy
exits within 15 s of SIGINT; busy, within the drain of what is in flight (at most 30 s)
plus 15 s; when its Ray head's GCS dies, within 10 s with a non-zero code; and
`neuron-serve shutdown` followed by SIGTERM to deploy's whole process group (a process
supervisor's stop) does not wait 60 s for the GCS that the signal also stopped.
"""

import http.client
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import pytest

from conftest import ROOT, Server
from http_client import Client, infer_body

sys.path.insert(0, str(Path(__file__).parent / "models"))
import faulty  # noqa: E402

pytestmark = pytest.mark.serial  # make test runs it apart: its bounds time the stops

CONFIG = "tests/integration/models/faulty.yaml"
IDLE_EXIT_S = 15
DRAIN_S = 30
GRACE_S = 15
HEAD_LOSS_EXIT_S = 10
# What a normal start and stop must not print, from deploy or from Ray's processes (Ray printed
# "(raylet) Task ServeController.graceful_shutdown failed. There are infinite retries remaining..."
# on every stop: Serve's controller ends the call that stops it by killing itself).
ALARMING = re.compile(r"graceful_shutdown failed|Traceback|\bERROR\b|\bWARNING\b|\bfailed\b|^error: ", re.MULTILINE)


@pytest.fixture
def server(tmp_path):
    srv = Server([CONFIG], tmp_path)
    # Ready answers once the server app runs; deploy logs "serving" a moment later.
    deadline = time.monotonic() + 60
    while "serving faulty" not in srv.log.read_text(errors="replace") and time.monotonic() < deadline:
        time.sleep(0.2)
    yield srv
    srv.stop()


def wait_exit(srv: Server, limit: float) -> tuple[int, float]:
    started = time.monotonic()
    try:
        code = srv.proc.wait(timeout=limit)
    except subprocess.TimeoutExpired:
        pytest.fail(f"deploy still running {limit} s later:\n{srv.tail()}")
    return code, time.monotonic() - started


def test_idle_sigint_exits_quickly_and_logs_each_step(server):
    server.proc.send_signal(signal.SIGINT)
    code, seconds = wait_exit(server, IDLE_EXIT_S)
    log = server.log.read_text(errors="replace")
    print(f"\nidle SIGINT: exit {code} after {seconds:.1f} s")
    assert code == 0, server.tail()
    assert "shutting down (SIGINT): draining in-flight requests, then stopping Ray Serve and Ray (at most 45 s)" in log
    assert "]: stopping 'faulty': waiting for in-flight requests (at most 30 s)" in log
    assert "]: stopping Ray Serve (its controller and HTTP ingress)" in log
    assert "]: stopping Ray\n" in log
    assert "stopped in " in log
    # Nothing alarming, starting or stopping: both are normal events.
    assert not [line for line in log.splitlines() if ALARMING.search(line)], log
    assert "will not be applied" not in log, log  # serve.run's reconnecting, as if settings were ignored


def test_busy_sigterm_exits_after_the_drain(server):
    # Requests that stall the model's CPU stage for faulty.STALL_S each: the replicas
    # are busy when the signal arrives.
    client = Client(server.url, timeout=DRAIN_S + GRACE_S, keep_alive=False)
    answers: list = []

    def send(value: float) -> None:
        try:
            answers.append(client.infer("faulty", infer_body([[value] + [0.0] * 7])).status)
        except OSError as exc:
            answers.append(type(exc).__name__)

    threads = [threading.Thread(target=send, args=(faulty.STALL_MARK,)) for _ in range(4)]
    threads += [threading.Thread(target=send, args=(0.5,)) for _ in range(4)]
    for t in threads:
        t.start()
    time.sleep(0.5)
    server.proc.send_signal(signal.SIGTERM)
    code, seconds = wait_exit(server, DRAIN_S + GRACE_S)
    for t in threads:
        t.join(timeout=10)
    print(f"\nbusy SIGTERM: exit {code} after {seconds:.1f} s; answers {answers}")
    assert code == 0, server.tail()
    # Each in-flight request got its answer: a result, or the JSON 504 of its timeout.
    assert len(answers) == 8 and set(answers) <= {200, 504}, answers


def steady_load(server: Server, stop_serving) -> tuple[list[tuple[float, float, str]], list[str], float]:
    """Six clients that honour Retry-After, each request on a new connection, while
    ``stop_serving()`` runs; returns every request's (start, seconds, outcome), the
    outcomes of the requests in flight when it began, and how long it took."""
    client = Client(server.url, timeout=DRAIN_S + GRACE_S, keep_alive=False)
    results: list[tuple[float, float, str]] = []
    stop = threading.Event()

    def loop(worker: int) -> None:
        while not stop.is_set():
            started = time.monotonic()
            try:
                answer = client.infer("faulty", infer_body([[0.1 * worker] * 8]))
            except ConnectionRefusedError:  # the port is closed: nothing was accepted
                results.append((started, time.monotonic() - started, "refused"))
                time.sleep(0.05)
                continue
            except (OSError, http.client.HTTPException) as exc:
                results.append((started, time.monotonic() - started, f"dropped: {type(exc).__name__}"))
                continue
            kind = str(answer.status)
            if answer.status != 200:
                assert answer.headers.get("content-type") == "application/json", answer.body
                kind += f" Retry-After: {answer.headers.get('retry-after')} {json.loads(answer.body)['error'][:40]}"
            results.append((started, time.monotonic() - started, kind))
            time.sleep(float(answer.headers.get("retry-after") or 0))

    threads = [threading.Thread(target=loop, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    time.sleep(2.0)
    began = time.monotonic()
    stop_serving()
    took = time.monotonic() - began
    time.sleep(1.0)
    stop.set()
    for t in threads:
        t.join(timeout=30)
    client.close()
    in_flight = [kind for start, spent, kind in results if start < began < start + spent]
    return results, in_flight, took


def assert_nothing_dropped(results: list[tuple[float, float, str]], in_flight: list[str]) -> Counter:
    outcomes = Counter(kind for _, _, kind in results)
    assert not [k for k in outcomes if k.startswith("5") and not k.startswith("503")], outcomes
    # No request that could reach a model is dropped. The one exception is the kernel's:
    # a connection whose handshake completes in the instant HAProxy closes the port sits
    # in the listening socket's accept queue, and closing that socket resets it. HAProxy
    # never read it, so it never reached a model; it can only come after HAProxy had
    # begun answering 503 (all models stopped), and at most one per run has been seen.
    first_refusal = min((start + spent for start, spent, kind in results if kind.startswith("503")), default=None)
    dropped = [(start, kind) for start, _, kind in results if kind.startswith("dropped")]
    assert len(dropped) <= 1 and all(
        kind == "dropped: ConnectionResetError" and first_refusal is not None and start > first_refusal
        for start, kind in dropped), (dropped, first_refusal, outcomes)
    # Requests in flight when the stop began were answered by the model.
    assert in_flight and set(in_flight) == {"200"}, in_flight
    # New requests get the JSON 503 with Retry-After until the port closes.
    refusals = [k for k in outcomes if k.startswith("503")]
    assert refusals and all(k.startswith("503 Retry-After: 1 no replica answered") for k in refusals), outcomes
    assert outcomes["refused"] > 0
    return outcomes


def test_sigterm_under_load_drops_no_connection(server):
    """Clients that honour Retry-After see answers or refused connections, never a drop."""
    def sigterm():
        server.proc.send_signal(signal.SIGTERM)
        assert wait_exit(server, DRAIN_S + GRACE_S)[0] == 0

    results, in_flight, took = steady_load(server, sigterm)
    print(f"\nSIGTERM under load: exit after {took:.1f} s; {dict(Counter(k for _, _, k in results))}")
    assert_nothing_dropped(results, in_flight)


def test_neuron_serve_shutdown_under_load_drops_no_connection(server):
    def shutdown():
        done = subprocess.run([sys.executable, "-m", "neuron_serve.cli", "shutdown", "--address",
                               server.ray_address()], cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-2000:]

    results, in_flight, took = steady_load(server, shutdown)
    print(f"\nneuron-serve shutdown under load: {took:.1f} s; {dict(Counter(k for _, _, k in results))}")
    assert_nothing_dropped(results, in_flight)


def test_losing_the_gcs_ends_deploy_with_a_message(server):
    gcs = [pid for pid in server.session_pids()
           if b"gcs_server" in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0]]
    assert len(gcs) == 1, gcs
    server.kill_pid(gcs[0])
    code, seconds = wait_exit(server, HEAD_LOSS_EXIT_S)
    print(f"\nGCS killed: exit {code} after {seconds:.1f} s")
    assert code == 1
    assert (f"error: Ray's gcs_server (pid {gcs[0]}) was killed by SIGKILL; the models cannot be served "
            "without it. Stopping.") in server.log.read_text(errors="replace")


def test_shutdown_then_sigterm_to_the_process_group_does_not_wait_for_the_gcs(server):
    done = subprocess.run([sys.executable, "-m", "neuron_serve.cli", "shutdown", "--address", server.ray_address()],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    os.killpg(server.proc.pid, signal.SIGTERM)  # deploy, and the GCS and raylet it started
    code, seconds = wait_exit(server, IDLE_EXIT_S)
    log = server.log.read_text(errors="replace")
    print(f"\nshutdown + SIGTERM to the group: exit {code} after {seconds:.1f} s")
    assert "Failed to connect to GCS" not in log
    assert code == 0, server.tail()
    assert "shutting down (SIGTERM)" in log
