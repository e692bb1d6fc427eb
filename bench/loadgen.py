"""The load generator: wrk (a C, epoll-based HTTP benchmarking tool) with a Lua script.

wrk keeps a fixed number of connections busy (closed loop, one request in flight per
connection, so concurrency = connections), sends a different pre-built body per
request from a manifest (W2's sequence lengths vary per request), and reports the
latency percentiles from its HdrHistogram-style distribution and every error:
connect/read/write/timeout socket errors and non-2xx responses.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from dataclasses import dataclass, asdict
from pathlib import Path

SCRIPT = Path(__file__).with_name("loadgen.lua")


@dataclass
class LoadResult:
    requests: int
    seconds: float
    rps: float
    p50_ms: float
    p90_ms: float
    p99_ms: float
    errors: int

    def as_dict(self) -> dict:
        return asdict(self)


def wrk_binary() -> str:
    found = shutil.which("wrk")
    if not found:
        raise SystemExit("bench needs wrk (the HTTP load generator): apt-get install wrk, or brew install wrk.")
    return found


def run_load(url: str, manifest: Path, concurrency: int, seconds: float, timeout_s: float = 10) -> LoadResult:
    """Drive ``url`` with ``concurrency`` connections for ``seconds``; one wrk thread is plenty on 2 cores."""
    command = [wrk_binary(), "-t1", f"-c{concurrency}", f"-d{max(1, round(seconds))}s", f"--timeout={timeout_s:g}s",
               "-s", str(SCRIPT), url, "--", str(manifest)]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=seconds + timeout_s + 30)
    line = next((l for l in proc.stdout.splitlines() if l.startswith("RESULT ")), None)
    if line is None:
        raise RuntimeError(f"wrk gave no result (rc {proc.returncode}): {proc.stdout[-500:]} {proc.stderr[-500:]}")
    raw = json.loads(line[len("RESULT "):])
    duration = raw["duration_us"] / 1e6
    errors = raw["connect"] + raw["read"] + raw["write"] + raw["status"] + raw["timeout"]
    ok = raw["requests"] - raw["status"]
    return LoadResult(raw["requests"], duration, ok / duration if duration else 0.0,
                      raw["p50_us"] / 1000, raw["p90_us"] / 1000, raw["p99_us"] / 1000, errors)
