"""Overload and latency figures of one replica, with the targets they are held to.

Deploys tests/integration/models/guarded.yaml (a small model whose batches take about
20 ms, one core, a queue of 16, a 2 s request timeout) and measures:

- p50 latency of single requests before and after a burst of 5x the replica's capacity;
- how fast the burst's refused requests get their 503 (target: before the request
  timeout, i.e. refused at once rather than queued);
- replica RSS before and after the burst (target: grows by less than 256 MiB);
- how long a request stalled past its deadline takes to get its 504 (target: within
  1.5 s of the timeout);
- the dynamic batcher's lone-request latency with a 100 ms delay (target: < 1 s).

The behaviour (status codes, messages, results) is asserted in the tests; only the
figures live here, since they depend on how busy the machine is.

    python -m bench.overload [--out DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests" / "integration"), str(ROOT / "tests" / "integration" / "models")]

from conftest import GUARDED_TOKEN, Server  # noqa: E402  - the tests' real `neuron-serve deploy`
from http_client import Client, infer_body  # noqa: E402

import faulty  # noqa: E402

MODEL = "guarded"
QUEUE, RUNNING, TIMEOUT_S = 16, 8, 2.0  # guarded.yaml: max_queue_size, 2 batches x 4 rows, request_timeout_s


def _rss_mib(pids: list[int]) -> float:
    total = 0
    for pid in pids:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                total += int(line.split()[1])
    return total / 1024


def _p50(api: Client, n: int = 30) -> float:
    return statistics.median(api.infer(MODEL, infer_body([[0.001 * i] * 8])).seconds for i in range(n))


def _burst(api: Client) -> dict:
    burst = 5 * (QUEUE + RUNNING)
    barrier = threading.Barrier(burst)

    def send(i):
        barrier.wait()
        return api.infer(MODEL, infer_body([[0.001 * i] * 8]))

    with ThreadPoolExecutor(burst) as pool:
        answers = list(pool.map(send, range(burst)))
    api.close()
    refused = [a.seconds for a in answers if a.status == 503]
    return {"burst": burst, "ok": sum(a.status == 200 for a in answers), "refused": len(refused),
            "slowest_503_s": max(refused, default=0.0)}


async def _lone_item_s() -> float:
    from neuron_serve.runtime.request_queue import DynamicBatcher  # noqa: PLC0415

    async def echo(items):
        return list(items)

    batcher = DynamicBatcher(echo, max_batch_size=8, max_queue_delay_s=0.1, max_queue_size=100, request_timeout_s=None)
    batcher.start()
    started = time.perf_counter()
    await batcher.submit("alone")
    elapsed = time.perf_counter() - started
    await batcher.stop(drain=True)
    return elapsed


def measure() -> dict:
    with tempfile.TemporaryDirectory(prefix="bench-overload-") as tmp:
        server = Server(["tests/integration/models/guarded.yaml"], Path(tmp), env={"GUARDED_TOKEN": GUARDED_TOKEN})
        try:
            api = Client(server.url, token=GUARDED_TOKEN)
            pids = server.replica_pids(MODEL)
            p50_before, rss_before = _p50(api), _rss_mib(pids)
            burst = _burst(api)
            rss_after, p50_after = _rss_mib(pids), _p50(api)
            stalled = api.infer(MODEL, infer_body([[faulty.STALL_MARK] + [0.0] * 7]))
            api.close()
        finally:
            server.stop()
    figures = {"p50_before_s": p50_before, "p50_after_s": p50_after, "rss_before_mib": rss_before,
               "rss_after_mib": rss_after, "timeout_answer_s": stalled.seconds, "timeout_status": stalled.status,
               "lone_item_s": asyncio.run(_lone_item_s()), **burst}
    figures["targets"] = {
        "503 before the request timeout": burst["slowest_503_s"] < TIMEOUT_S,
        "RSS grows < 256 MiB in the burst": rss_after < rss_before + 256,
        "p50 after the burst < 2x before + 20 ms": p50_after < 2 * p50_before + 0.02,
        "504 within 1.5 s of the timeout": TIMEOUT_S <= stalled.seconds < TIMEOUT_S + 1.5,
        "lone request dispatched < 1 s (delay 100 ms)": figures["lone_item_s"] < 1.0,
    }
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="also write overload.json here")
    args = parser.parse_args(argv)
    figures = measure()
    print(f"p50 {figures['p50_before_s'] * 1e3:.1f} -> {figures['p50_after_s'] * 1e3:.1f} ms; "
          f"burst {figures['burst']}: {figures['ok']} x 200, {figures['refused']} x 503 "
          f"(slowest 503 {figures['slowest_503_s'] * 1e3:.0f} ms); RSS {figures['rss_before_mib']:.0f} -> "
          f"{figures['rss_after_mib']:.0f} MiB; 504 after {figures['timeout_answer_s']:.2f}s; "
          f"lone request {figures['lone_item_s'] * 1e3:.0f} ms")
    for target, met in figures["targets"].items():
        print(f"  {'met' if met else 'MISSED'}: {target}")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "overload.json").write_text(json.dumps(figures, indent=1))
    return 0 if all(figures["targets"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
