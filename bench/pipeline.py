"""A pipelined model against the same model replicated, on neuron-serve's runtime (no HTTP).

    python -m bench.pipeline [--cores 2] [--requests 200] [--concurrency 8] [--json out.json]

One model whose compute and memory sit in different layers (four rounds of 256x256
matrix products, then four 4 MiB tables read one row each; the same architecture as
tests/unit/partition/test_pipeline_balance.py) is built four ways on ``--cores`` emulated cores:
replicated (a whole copy per core), and pipelined over two cores split by memory
(``size_based``), by torch's ``kl_based`` and by even latency (``latency``), with a core
memory of 21.5 MB so the model needs two cores. For each: requests per second and the
median request latency of ``--requests`` single-chunk requests, ``--concurrency`` in
flight, through ModelRunner; and the stage balance, the slowest stage's median time over
the mean of the stages' medians, one request at a time (under load a stage's time
includes waiting for its core) (1.0: even; 2.0 for two stages: one does everything).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

os.environ.setdefault("PJRT_DEVICE", "CPU")
os.environ.setdefault("CPU_NUM_DEVICES", "2")
os.environ.setdefault("NEURON_SERVE_CORE_MEMORY_BYTES", "21500000")

import torch  # noqa: E402
from torch import nn  # noqa: E402

import neuron_serve  # noqa: E402
from neuron_serve.runtime.observer import RuntimeObserver  # noqa: E402
from neuron_serve.runtime.runner import ModelRunner  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "deployments"))  # example_models
from example_models.compute_then_tables import ComputeThenTables  # noqa: E402

ROWS = 256
PLACEMENTS = {
    "replicate": None,
    "pipeline size_based": {"mode": "pipeline", "cores_per_pipeline": 2, "balance": "size_based"},
    "pipeline kl_based": {"mode": "pipeline", "cores_per_pipeline": 2, "balance": "kl_based"},
    "pipeline latency": {"mode": "pipeline", "cores_per_pipeline": 2, "balance": "latency"},
}


class StageTimes(RuntimeObserver):
    """The runner's per-stage timings, by partition."""

    def __init__(self) -> None:
        self.samples: dict[str, list[float]] = defaultdict(list)

    def stage(self, partition: str, device: str, core: int, seconds: float) -> None:
        self.samples[partition].append(seconds)

    def balance(self) -> float:
        medians = [statistics.median(v) for v in self.samples.values()]
        return max(medians) / (sum(medians) / len(medians))


async def _load(runner: ModelRunner, requests: int, concurrency: int) -> tuple[float, list[float]]:
    gate = asyncio.Semaphore(concurrency)
    latencies: list[float] = []
    x = torch.randn(ROWS, ROWS)

    async def one() -> None:
        async with gate:
            started = time.perf_counter()
            [result] = await runner.infer([[x]])
            if isinstance(result, Exception):
                raise result
            latencies.append(time.perf_counter() - started)

    started = time.perf_counter()
    await asyncio.gather(*(one() for _ in range(requests)))
    return time.perf_counter() - started, latencies


def measure(name: str, model: nn.Module, cores: int, requests: int, concurrency: int) -> dict:
    x = torch.randn(ROWS, ROWS)
    traced = neuron_serve.dynamic_batch(neuron_serve.trace(model, x, placement=PLACEMENTS[name]))
    stages = StageTimes()
    runner = ModelRunner(traced, cores=cores, name=name, observer=stages)
    try:
        asyncio.run(_load(runner, 2 * concurrency, concurrency))  # warm-up
        seconds, latencies = asyncio.run(_load(runner, requests, concurrency))
        # Stage times one request at a time: under load a stage's time includes its wait for the core.
        stages.samples.clear()
        asyncio.run(_load(runner, max(10, requests // 4), 1))
    finally:
        runner.close()
    return {"placement": name, "stages": [f"{p.name}@core{p.core}" for p in traced.partitions],
            "copies": runner.copies, "requests_per_s": requests / seconds,
            "p50_ms": statistics.median(latencies) * 1000, "stage_balance": stages.balance()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cores", type=int, default=int(os.environ["CPU_NUM_DEVICES"]))
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    args = parser.parse_args()
    torch.manual_seed(0)
    model = ComputeThenTables().eval()
    rows = [measure(name, model, args.cores, args.requests, args.concurrency) for name in PLACEMENTS]
    print(f"{'placement':<22}{'stages':<28}{'copies':>7}{'req/s':>9}{'p50 ms':>9}{'balance':>9}")
    for r in rows:
        print(f"{r['placement']:<22}{' '.join(r['stages']):<28}{r['copies']:>7}{r['requests_per_s']:>9.1f}"
              f"{r['p50_ms']:>9.2f}{r['stage_balance']:>9.2f}")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"cores": args.cores, "requests": args.requests, "concurrency": args.concurrency,
                       "rows": rows}, handle, indent=2)


if __name__ == "__main__":
    main()
