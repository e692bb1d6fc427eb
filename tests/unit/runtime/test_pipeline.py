"""Pipeline: one bucket's stages, accelerator ones on the core's thread, CPU ones in the pool or in place."""

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from neuron_serve.runtime.cores import CorePool
from neuron_serve.runtime.observer import RuntimeObserver
from neuron_serve.runtime.pipeline import Pipeline

TOLERANCE = 1e-5  # XLA:CPU vs eager float sums


class Stages(RuntimeObserver, list):
    """Records (partition, device, core) of every stage run."""

    def stage(self, partition, device, core, seconds):
        self.append((partition, device, core))


def test_a_chunk_runs_every_stage_where_its_partition_lives_and_equals_eager(built, eager):
    cores, cpu_pool = CorePool(1), ThreadPoolExecutor(2, thread_name_prefix="cpu-test")
    stages = Stages()
    try:
        pipeline = Pipeline(built.first, cores, cpu_pool, observer=stages)
        x = torch.rand(built.first.batch_size, 8)
        [out] = asyncio.run(pipeline.run([x], cores.next()))
    finally:
        cpu_pool.shutdown()
        cores.shutdown()
    torch.testing.assert_close(out, eager(x), atol=TOLERANCE, rtol=TOLERANCE)
    assert stages == [("accel_0", "neuron", 0), ("cpu_0", "cpu", 0)]


@pytest.mark.parametrize("in_place, thread", [(set(), "cpu-test"), ({"cpu_0"}, "core0")])
def test_a_cpu_stage_runs_in_the_pool_or_in_place_on_the_core_thread_and_equals_eager(built, eager, in_place, thread):
    cores, cpu_pool = CorePool(1), ThreadPoolExecutor(2, thread_name_prefix="cpu-test")
    stages, threads = Stages(), []
    try:
        pipeline = Pipeline(built.first, cores, cpu_pool, observer=stages)
        pipeline.run_in_place(in_place)
        hook = pipeline.cpu_modules["cpu_0"].register_forward_pre_hook(
            lambda *_: threads.append(threading.current_thread().name))
        x = torch.rand(built.first.batch_size, 8)
        [out] = asyncio.run(pipeline.run([x], cores.next()))
        hook.remove()
    finally:
        cpu_pool.shutdown()
        cores.shutdown()
    torch.testing.assert_close(out, eager(x), atol=TOLERANCE, rtol=TOLERANCE)
    assert [name.split("_")[0] for name in threads] == [thread]
    assert stages == [("accel_0", "neuron", 0), ("cpu_0", "cpu", 0)]


def test_only_cpu_stages_can_run_in_place(built):
    cores, cpu_pool = CorePool(1), ThreadPoolExecutor(1)
    try:
        pipeline = Pipeline(built.first, cores, cpu_pool)
        with pytest.raises(ValueError, match=r"run_in_place: \['accel_0'\] are not CPU stages of this bucket"):
            pipeline.run_in_place({"accel_0"})
    finally:
        cpu_pool.shutdown()
        cores.shutdown()
