"""Pipeline: one bucket's stages, accelerator ones on the core's thread, CPU ones in the pool."""

import asyncio
from concurrent.futures import ThreadPoolExecutor

import torch

from neuron_serve.runtime.cores import CorePool
from neuron_serve.runtime.pipeline import Pipeline

TOLERANCE = 1e-5  # XLA:CPU vs eager float sums


def test_a_chunk_runs_every_stage_where_its_partition_lives_and_equals_eager(built, eager):
    cores, cpu_pool = CorePool(1), ThreadPoolExecutor(2, thread_name_prefix="cpu-test")
    stages = []
    try:
        pipeline = Pipeline(built.first, cores, cpu_pool, on_stage=lambda *stage: stages.append(stage[:3]))
        x = torch.rand(built.first.batch_size, 8)
        [out] = asyncio.run(pipeline.run([x], cores.next()))
    finally:
        cpu_pool.shutdown()
        cores.shutdown()
    torch.testing.assert_close(out, eager(x), atol=TOLERANCE, rtol=TOLERANCE)
    assert stages == [("accel_0", "neuron", 0), ("cpu_0", "cpu", 0)]
