"""Stopping `neuron-serve deploy` is quick and says what it waits for; losing Ray's head ends it.

The bounds are the ones users are promised (README, "Faults and shutdown"): idle, deploy
exits within 15 s of SIGINT; busy, within the drain of what is in flight (at most 30 s)
plus 15 s; when its Ray head's GCS dies, within 10 s with a non-zero code; and
`neuron-serve shutdown` followed by SIGTERM to deploy's whole process group (a process
supervisor's stop) does not wait 60 s for the GCS that the signal also stopped.
"""

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from conftest import ROOT, Server
from http_client import Client, infer_body

sys.path.insert(0, str(Path(__file__).parent / "models"))
import faulty  # noqa: E402

CONFIG = "tests/integration/models/faulty.yaml"
IDLE_EXIT_S = 15
DRAIN_S = 30
GRACE_S = 15
HEAD_LOSS_EXIT_S = 10


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
