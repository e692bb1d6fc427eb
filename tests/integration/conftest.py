"""A real `neuron-serve deploy` on loopback, shared by the serving tests of a module."""

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
READY_TIMEOUT_S = 600


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, configs: list[str], tmp: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tmp / "deploy.log"
        env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # always an embedded Ray
        env["PYTHONWARNINGS"] = "ignore"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "neuron_serve.cli", "deploy", *configs, "--port", str(self.port)],
            cwd=ROOT, env=env, stdout=self.log.open("wb"), stderr=subprocess.STDOUT, start_new_session=True,
        )
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"neuron-serve deploy exited {self.proc.returncode}:\n{self.tail()}")
            try:
                with urllib.request.urlopen(self.url + "/v2/health/ready", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(1)
        self.stop()
        raise RuntimeError(f"not ready after {READY_TIMEOUT_S}s:\n{self.tail()}")

    def tail(self) -> str:
        return self.log.read_bytes()[-4000:].decode(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=90)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)


@pytest.fixture(scope="session")
def server_factory():
    """Start another real server: ``server_factory([model.yaml or artifact dir, ...], tmp_dir)``."""
    return Server


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    """mlp (sort on CPU, 2 cores) and encoder (sequence buckets) served side by side."""
    srv = Server(["deployments/mlp.yaml", "deployments/encoder.yaml"], tmp_path_factory.mktemp("serve"))
    yield srv
    srv.stop()
