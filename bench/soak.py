"""Soak: `neuron-serve deploy deployments/mlp.yaml` under steady load for minutes.

    python -m bench.soak [--minutes 10] [--fraction 0.8] [--concurrency 16] [--invalid 0.1]

Measures the server's capacity first (wrk, closed loop, W1 and W3 requests for
--capacity-seconds), then drives it at --fraction of that rate (each connection waits
between requests) with a mix of valid requests (JSON and binary) and --invalid
type-confused ones (the answers must be 400), one wrk run per minute. Prints, per minute,
the rate reached, p50 and p99 and the answers by kind; the replica RSS at the start and
the end; and exits 1 when RSS grew 5% or more or an answer was neither 200 nor the 400
of an invalid request (socket errors, 5xx, timeouts). Not part of `make test`: `make soak`.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from .loadgen import run_load, wrk_binary
from .servers import Server, ServerSpec
from .workloads import WORKLOADS, first_body, write_bodies

SCRIPT = Path(__file__).with_name("soak.lua")
RSS_GROWTH_LIMIT = 0.05
PORT = 18450


def invalid_bodies(directory: Path, count: int, seed: int = 0) -> list[str]:
    """Manifest lines of requests with a field of the wrong JSON type (each answered 400)."""
    rng = random.Random(seed)
    x = {"name": "x", "shape": [1, 784], "datatype": "FP32", "data": [0.5] * 784}
    mutations = [("datatype", ["FP32"]), ("datatype", {"t": 1}), ("shape", "1,784"), ("shape", [1.5, 784]),
                 ("name", 7), ("data", "0.5"), ("data", None), ("parameters", [1]), ("extra", 1)]
    lines = []
    for i in range(count):
        key, value = rng.choice(mutations)
        doc = {"inputs": [{**x, key: value}]}
        path = directory / f"invalid-{i:04d}.json"
        path.write_bytes(json.dumps(doc).encode())
        lines.append(f"{path} 0")
    return lines


def soak_minute(url: str, manifest: Path, concurrency: int, delay_ms: int, seconds: int) -> dict:
    command = [wrk_binary(), "-t1", f"-c{concurrency}", f"-d{seconds}s", "--timeout=10s",
               "-s", str(SCRIPT), url, "--", str(manifest), str(delay_ms)]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=seconds + 60)
    line = next((l for l in proc.stdout.splitlines() if l.startswith("RESULT ")), None)
    if line is None:
        raise RuntimeError(f"wrk gave no result (rc {proc.returncode}): {proc.stdout[-500:]} {proc.stderr[-500:]}")
    return json.loads(line[len("RESULT "):])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=10)
    parser.add_argument("--fraction", type=float, default=0.8, help="of the measured capacity")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--invalid", type=float, default=0.1, help="share of invalid requests")
    parser.add_argument("--capacity-seconds", type=float, default=20)
    args = parser.parse_args(argv)

    work = Path(tempfile.mkdtemp(prefix="neuron-serve-soak-"))
    valid = [write_bodies(WORKLOADS[w], work / w, count=64) for w in ("W1", "W3-mlp")]
    valid_lines = [line for m in valid for line in m.read_text().splitlines() if line]
    n_invalid = round(len(valid_lines) * args.invalid / (1 - args.invalid))
    mixed = work / "mixed.txt"
    lines = valid_lines + invalid_bodies(work, n_invalid)
    random.Random(0).shuffle(lines)
    mixed.write_text("\n".join(lines) + "\n")
    capacity_manifest = work / "valid.txt"
    capacity_manifest.write_text("\n".join(valid_lines) + "\n")

    cli = str(Path(sys.executable).with_name("neuron-serve"))
    spec = ServerSpec("neuron-serve", "neuron-serve", [cli, "deploy", "deployments/mlp.yaml", "--host", "127.0.0.1",
                                                      "--port", str(PORT)], PORT, replica_marker="ray::ServeReplica:")
    server = Server(spec, work / "logs")
    try:
        server.wait_ready({"mlp": first_body(valid[0])})
        url = server.url("mlp")
        capacity = run_load(url, capacity_manifest, args.concurrency, args.capacity_seconds)
        target = args.fraction * capacity.rps
        # Each connection sends one request per concurrency/target seconds: its wait is
        # that period minus the time a request takes at this load (about p50 at capacity,
        # an overestimate at 80%, so the rate reached is printed next to the target).
        delay_ms = max(0, round(args.concurrency / target * 1000 - capacity.p50_ms))
        rss_start = server.memory_mb()
        print(f"capacity {capacity.rps:.1f} req/s (p50 {capacity.p50_ms:.1f} ms, p99 {capacity.p99_ms:.1f} ms, "
              f"concurrency {args.concurrency}); soak target {target:.1f} req/s = {args.fraction:.0%}, "
              f"{args.invalid:.0%} invalid; each connection waits {delay_ms} ms", flush=True)
        print(f"replica RSS at start: {', '.join(f'{k} {v:.0f} MB' for k, v in rss_start.items())}", flush=True)
        print("| minute | req/s | p50 ms | p99 ms | answers |\n| --- | --- | --- | --- | --- |", flush=True)
        totals: Counter = Counter()
        minutes = max(1, round(args.minutes))
        for minute in range(1, minutes + 1):
            seconds = 60 if args.minutes >= 1 else max(5, round(args.minutes * 60))
            raw = soak_minute(url, mixed, args.concurrency, delay_ms, seconds)
            kinds = Counter({f"HTTP {k}": v for k, v in raw["statuses"].items()})
            kinds.update({k: raw[k] for k in ("connect", "read", "write", "timeout") if raw[k]})
            totals.update(kinds)
            rate = raw["requests"] / (raw["duration_us"] / 1e6)
            print(f"| {minute} | {rate:.1f} | {raw['p50_us'] / 1000:.1f} | {raw['p99_us'] / 1000:.1f} | "
                  f"{dict(sorted(kinds.items()))} |", flush=True)
        rss_end = server.memory_mb()
        print(f"replica RSS at end: {', '.join(f'{k} {v:.0f} MB' for k, v in rss_end.items())}")
        growth = {k: rss_end[k] / rss_start[k] - 1 for k in rss_start if k in rss_end}
        print(f"RSS growth: {', '.join(f'{k} {g:+.1%}' for k, g in growth.items())}")
        unexpected = {k: v for k, v in totals.items() if k not in ("HTTP 200", "HTTP 400")}
        print(f"answers: {dict(sorted(totals.items()))}; unexpected: {unexpected or 'none'}")
        failed = bool(unexpected) or not growth or any(g >= RSS_GROWTH_LIMIT for g in growth.values())
        return 1 if failed else 0
    finally:
        server.stop()


if __name__ == "__main__":
    sys.exit(main())
