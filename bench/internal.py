"""Internal figures, measured on neuron-serve's runtime directly (no HTTP).

    PJRT_DEVICE=CPU CPU_NUM_DEVICES=2 python -m bench.internal [--quick] --json out.json

- pipeline efficiency: chunks/s through ModelRunner's pipelines over the bound
  min(cores / accelerator time, CPU workers / CPU time), both stage times measured
  alone on an idle runner;
- dynamic batch scaling: time of a batch of b rows against the summed measured cost
  of the compiled sizes the runner chose for it, over the cores;
- a compiled accelerator subgraph against the same FX subgraph in eager PyTorch.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import statistics
import time
from collections import defaultdict
from pathlib import Path

os.environ.setdefault("PJRT_DEVICE", "CPU")
os.environ.setdefault("CPU_NUM_DEVICES", "2")

import torch  # noqa: E402

from neuron_serve.compile.subgraph import CompiledSubgraph  # noqa: E402
from neuron_serve.config.schema import load_config  # noqa: E402
from neuron_serve.assembly.from_config import build  # noqa: E402
from neuron_serve.runtime.observer import RuntimeObserver  # noqa: E402
from neuron_serve.runtime.runner import ModelRunner  # noqa: E402

CONFIG_INPUTS: dict[str, list] = {}  # model name -> its model.yaml inputs (value ranges of integer inputs)

ROOT = Path(__file__).resolve().parents[1]


class StageTimes(RuntimeObserver):
    """Collects the runner's per-stage timings by device (accelerator vs cpu)."""

    def __init__(self) -> None:
        self.samples: dict[str, list[float]] = defaultdict(list)

    def stage(self, partition: str, device: str, core: int, seconds: float) -> None:
        self.samples["cpu" if device == "cpu" else "accel"].append(seconds)

    def reset(self) -> None:
        self.samples.clear()

    def median(self, device: str) -> float:
        values = self.samples.get(device)
        return statistics.median(values) if values else 0.0


def _chunk(runner: ModelRunner, bucket: int, rows: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(rows)
    chunk = []
    for spec, example in zip(CONFIG_INPUTS[runner.name], runner.model.buckets[bucket].input_shapes):
        shape = (rows, *example[0][1:])
        if example[1].is_floating_point:
            chunk.append(torch.randn(shape, generator=generator, dtype=example[1]))
        else:
            chunk.append(torch.randint(1, int(spec.high or 2), shape, generator=generator, dtype=example[1]))
    return chunk


async def _timed(coro_factory, repeats: int) -> float:
    """Median seconds of ``repeats`` sequential awaits."""
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        await coro_factory()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


async def pipeline_efficiency(runner: ModelRunner, timer: StageTimes, bucket: int, quick: bool) -> dict:
    pipeline = runner.pipelines[bucket][runner.model.first.batch_size]  # the largest compiled size
    chunk = _chunk(runner, bucket, runner.model.first.batch_size)
    core = runner.cores.cores[0]
    for _ in range(3):
        await pipeline.run(chunk, core)
    timer.reset()
    one_chunk = await _timed(lambda: pipeline.run(chunk, core), 5 if quick else 15)
    accel, cpu = timer.median("accel"), timer.median("cpu")
    stages = len([p for p in runner.model.buckets[bucket].partitions])
    accel_total = accel * sum(1 for p in runner.model.buckets[bucket].partitions if p.device != "cpu")
    cpu_total = cpu * sum(1 for p in runner.model.buckets[bucket].partitions if p.device == "cpu")
    cores, workers = len(runner.cores), runner.cpu_pool._max_workers
    bound = min(cores / accel_total if accel_total else math.inf, workers / cpu_total if cpu_total else math.inf)
    inflight = 4 * cores
    total = (8 if quick else 24) * cores
    started = time.perf_counter()

    async def worker(n: int) -> None:
        for _ in range(n):
            await pipeline.run(chunk, runner.cores.next())

    await asyncio.gather(*(worker(total // inflight) for _ in range(inflight)))
    measured = (total // inflight) * inflight / (time.perf_counter() - started)
    return {"stages": stages, "accel_s": accel_total, "cpu_s": cpu_total, "one_chunk_s": one_chunk,
            "cores": cores, "cpu_workers": workers, "bound_chunks_per_s": bound,
            "measured_chunks_per_s": measured, "efficiency": measured / bound}


async def batch_scaling(runner: ModelRunner, bucket: int, sizes: list[int], quick: bool) -> list[dict]:
    cores = len(runner.cores)
    rows = []
    for b in sizes:
        batch = _chunk(runner, bucket, b)
        await runner._run_rows(bucket, batch)
        measured = await _timed(lambda: runner._run_rows(bucket, batch), 3 if quick else 8)
        plan = runner.plan(bucket, b)
        formula = sum(runner.costs[bucket][size] for size in plan) / min(cores, len(plan))
        rows.append({"batch": b, "plan": plan, "measured_s": measured, "formula_s": formula,
                     "ratio": measured / formula})
    return rows


def compiled_vs_eager(runner: ModelRunner, bucket: int, quick: bool) -> list[dict]:
    """Each accelerator subgraph on core 0 against its own FX source run eagerly on CPU."""
    core = runner.cores.cores[0]
    repeats = 10 if quick else 30
    rows = []
    for name, module in runner.pipelines[bucket][runner.model.first.batch_size].modules[0].items():
        assert isinstance(module, CompiledSubgraph)
        args = module.example_args
        eager = module.source

        def run_compiled():
            return core.submit(module, *args).result()

        def run_eager():
            with torch.no_grad():
                return eager(*args)

        timings = {}
        for label, fn in (("compiled", run_compiled), ("eager", run_eager)):
            for _ in range(3):
                fn()
            samples = []
            for _ in range(repeats):
                started = time.perf_counter()
                fn()
                samples.append(time.perf_counter() - started)
            timings[label] = statistics.median(samples)
        rows.append({"subgraph": name, "compiled_s": timings["compiled"], "eager_s": timings["eager"],
                     "speedup": timings["eager"] / timings["compiled"]})
    return rows


async def measure(config_path: Path, quick: bool, sizes: list[int]) -> dict:
    timer = StageTimes()
    config = load_config(config_path)
    started = time.perf_counter()
    model = build(config, config_path.resolve().parent)
    runner = ModelRunner(model, cores=config.cores_per_replica, name=config.name, observer=timer)
    CONFIG_INPUTS[config.name] = config.inputs
    build_s = time.perf_counter() - started
    bucket = len(runner.model.buckets) - 1  # the largest bucket: the most work per chunk
    try:
        return {
            "model": config.name, "build_s": build_s, "batch_sizes": runner.model.batch_sizes,
            "costs_s": runner.costs[bucket],
            "partitions": [p.device for p in runner.model.buckets[bucket].partitions],
            "pipeline": await pipeline_efficiency(runner, timer, bucket, quick),
            "batch_scaling": await batch_scaling(runner, bucket, sizes, quick),
            "compiled_vs_eager": compiled_vs_eager(runner, bucket, quick),
        }
    finally:
        runner.close()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--models", default="mlp,encoder")
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    plans = {"mlp": (ROOT / "deployments/mlp.yaml", [64, 100, 128, 256]),
             "encoder": (ROOT / "deployments/encoder.yaml", [8, 13, 16, 32])}
    results = []
    for name in args.models.split(","):
        path, sizes = plans[name]
        results.append(asyncio.run(measure(path, args.quick, sizes)))
    args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
