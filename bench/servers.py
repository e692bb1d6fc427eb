"""Starting, probing, measuring and stopping each server under test.

Every server runs as its own process group, so stopping it ends everything it
started (Ray's raylet and workers, LitServe's workers) and nothing else.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class ServerSpec:
    key: str
    label: str
    command: list[str]
    port: int
    binary: bool = True               # serves the binary tensor extension (W3)
    startup_s: float = 600
    replica_marker: str | None = None  # cmdline prefix of replica processes (Ray actors)
    grpc_port: int | None = None       # serves OIP v2 over gRPC there
    env: dict[str, str] = field(default_factory=dict)
    ready_line: str | None = None      # also wait for this line in its log (all of it started, not one model)


# neuron-serve deploy's last start-up line: every app started, the server app's routes too.
# A model answers before it (its app is ready first), so a probe alone is not enough.
READY_LINE = "/v2 (metrics: /metrics"


def specs(python: str = sys.executable) -> dict[str, ServerSpec]:
    cli = str(Path(python).with_name("neuron-serve"))
    deploy = [cli, "deploy", "deployments/mlp.yaml", "deployments/encoder.yaml", "--host", "127.0.0.1"]
    return {s.key: s for s in [
        ServerSpec("neuron-serve", "neuron-serve", deploy + ["--port", "18400", "--grpc-port", "18401"], 18400,
                   replica_marker="ray::ServeReplica:", grpc_port=18401, ready_line=READY_LINE),
        ServerSpec("ray-proxy", "Ray Serve, default HTTP proxy",
                   [python, "-m", "bench.peers.ray_app", "--port", "18200"], 18200,
                   replica_marker="ray::ServeReplica:"),
        ServerSpec("ray-haproxy", "Ray Serve, HAProxy direct ingress",
                   [python, "-m", "bench.peers.ray_app", "--port", "18500", "--haproxy"], 18500,
                   replica_marker="ray::ServeReplica:"),
        ServerSpec("ray-neuron", "Ray Serve tutorial: compiled at batch 1, HAProxy",
                   [python, "-m", "bench.peers.ray_neuron_app", "--port", "18600", "--haproxy"], 18600,
                   replica_marker="ray::ServeReplica:"),
        ServerSpec("ray-neuron-batch", "Ray Serve tutorial: @serve.batch + dynamic_batch, HAProxy",
                   [python, "-m", "bench.peers.ray_neuron_app", "--port", "18700", "--haproxy", "--batch"], 18700,
                   replica_marker="ray::ServeReplica:"),
        ServerSpec("litserve", "LitServe, batching", [python, "-m", "bench.peers.litserve_app", "--port", "18300"],
                   18300, binary=False),
        ServerSpec("starlette", "uvicorn + Starlette, eager",
                   [python, "-m", "bench.peers.starlette_app", "--port", "18100"], 18100),
    ]}


class Server:
    """One running server under test."""

    def __init__(self, spec: ServerSpec, log_dir: Path) -> None:
        self.spec = spec
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = log_dir / f"{spec.key}.log"
        self._log = open(self.log_path, "w")
        env = {**os.environ, "PYTHONPATH": f"{ROOT}:{os.environ.get('PYTHONPATH', '')}", **spec.env}
        env.pop("RAY_ADDRESS", None)
        self.proc = subprocess.Popen(spec.command, cwd=ROOT, env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        self.started = time.monotonic()

    def url(self, model: str) -> str:
        return f"http://127.0.0.1:{self.spec.port}/v2/models/{model}/infer"

    def wait_ready(self, probes: dict[str, tuple[bytes, dict]]) -> float:
        """Block until every model answers a real request with 200 (and ``ready_line`` is logged), and for
        neuron-serve until its background compile is done; returns the seconds to ready."""
        deadline = self.started + self.spec.startup_s
        pending = dict(probes)
        while pending or (self.spec.ready_line and self.spec.ready_line not in self.log_path.read_text(errors="replace")):
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.spec.key} exited with {self.proc.returncode}; see {self.log_path}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.spec.key} not ready after {self.spec.startup_s}s; see {self.log_path}")
            for model, (body, headers) in list(pending.items()):
                try:
                    request = urllib.request.Request(self.url(model), data=body, headers=headers, method="POST")
                    with urllib.request.urlopen(request, timeout=30) as response:
                        if response.status == 200:
                            del pending[model]
                except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                    pass
            time.sleep(1 if pending else 0.2)
        ready = time.monotonic() - self.started
        if self.spec.ready_line == READY_LINE:  # neuron-serve: measured once its background compile is done
            self.wait_compiled(deadline)
        return ready

    def wait_compiled(self, deadline: float) -> None:
        """Block until no replica has a model left to compile (``neuron_serve_compiled_models`` in state pending:
        a replica serves on its first compiled models while the rest compile behind)."""
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.spec.port}/metrics", timeout=30) as response:
                    text = response.read().decode()
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                text = ""
            pending = [line for line in text.splitlines()
                       if line.startswith("neuron_serve_compiled_models{") and 'state="pending"' in line]
            # No series yet is not "none pending": a replica counts its models from the start.
            if pending and not any(float(line.rsplit(" ", 1)[1]) > 0 for line in pending):
                return
            time.sleep(2)
        raise RuntimeError(f"{self.spec.key} still compiling after {self.spec.startup_s}s; see {self.log_path}")

    def memory_mb(self) -> dict[str, float]:
        """Resident memory: per replica process for Ray servers, else the whole process tree."""
        procs = _tree(self.proc.pid)
        marker = self.spec.replica_marker
        if marker:
            replicas = {name: rss for name, rss in procs if name.startswith(marker)}
            return {name[len(marker):].split(" ")[0]: rss for name, rss in replicas.items()}
        return {"process tree": sum(rss for _, rss in procs)}

    def stop(self) -> None:
        tree = [pid for pid in _pids(self.proc.pid) if pid != self.proc.pid]
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGINT)
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
            except ProcessLookupError:
                pass
        # Ray's helpers may outlive the driver for a moment; the group goes with them.
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        for pid in tree:  # anything that left the group (Ray starts some daemons in their own)
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self._log.close()


def _pids(root: int) -> list[int]:
    """``root`` and its descendants, from /proc."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry.name))
    found, stack = [], [root]
    while stack:
        pid = stack.pop()
        stack.extend(children.get(pid, []))
        found.append(pid)
    return found


def _tree(root: int) -> list[tuple[str, float]]:
    """(cmdline, RSS MiB) of ``root`` and its descendants."""
    found = []
    for pid in _pids(root):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
            rss_kb = next(int(l.split()[1]) for l in Path(f"/proc/{pid}/status").read_text().splitlines()
                          if l.startswith("VmRSS:"))
        except (OSError, StopIteration):
            continue
        found.append((cmdline, rss_kb / 1024))
    return found
