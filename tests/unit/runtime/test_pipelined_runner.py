"""A pipelined model in the runner: each stage a compiled executable on its own core, chunks spread over
copies of the pipeline (saturate_host), outputs equal eager. In a subprocess: four emulated cores need
CPU_NUM_DEVICES=4 before torch_xla starts."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

RUN = """
import asyncio, json, sys, torch
sys.path.insert(0, sys.argv[1])
import neuron_serve
from neuron_serve.compile.subgraph import CompiledSubgraph
from neuron_serve.runtime.observer import RuntimeObserver
from neuron_serve.runtime.runner import ModelRunner
from test_pipeline_placement import FourLayers

class Stages(RuntimeObserver, list):
    def stage(self, name, device, core, seconds):
        self.append((name, core))

torch.manual_seed(0)
model = FourLayers().eval()
report = {}
for saturate in (True, False):
    traced = neuron_serve.dynamic_batch(neuron_serve.trace(
        model, torch.randn(4, 64), batch_sizes=[4],
        placement={"mode": "pipeline", "cores_per_pipeline": 2, "saturate_host": saturate}))
    ran = Stages()
    runner = ModelRunner(traced, cores=4, observer=ran)
    xs = [torch.randn(rows, 64) for rows in (4, 3, 8, 1, 4, 5)]

    async def all_at_once():
        return await asyncio.gather(*(runner.infer([[x]]) for x in xs))

    for [[out]], x in zip(asyncio.run(all_at_once()), xs):
        with torch.no_grad():
            torch.testing.assert_close(out, model(x), rtol=1e-5, atol=1e-5)
    [grid] = runner.pipelines
    loaded = {core: {name: type(m).__name__ for name, m in mods.items()} for core, mods in enumerate(grid[4].modules)}
    report[str(saturate)] = {"groups": runner.groups, "loaded": loaded,
                             "ran": sorted(set(ran)), "stages": len(ran)}
    runner.close()
print(json.dumps(report))
"""


@pytest.fixture(scope="module")
def report():
    env = {**os.environ, "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "4", "PYTHONWARNINGS": "ignore",
           "NEURON_SERVE_CORE_MEMORY_BYTES": "40000"}  # FourLayers needs two cores of 40000 bytes
    result = subprocess.run([sys.executable, "-c", RUN, str(Path(__file__).parents[1] / "partition")],
                            capture_output=True, text=True, timeout=600, env=env)
    # The subprocess asserts every output equals eager within rtol=atol=1e-5.
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.splitlines()[-1])


def test_each_stage_is_a_compiled_executable_on_its_core_of_each_copy(report):
    saturated = report["True"]
    assert saturated["groups"] == [[0, 1], [2, 3]]
    assert saturated["loaded"] == {"0": {"accel_0": "CompiledSubgraph"}, "1": {"accel_1": "CompiledSubgraph"},
                                   "2": {"accel_0": "CompiledSubgraph"}, "3": {"accel_1": "CompiledSubgraph"}}


def test_chunks_round_robin_over_pipeline_copies(report):
    # 4+3+8+1+4+5 rows at batch size 4: 1+1+2+1+1+2 = 8 chunks, each running both stages.
    saturated = report["True"]
    assert saturated["stages"] == 16
    assert saturated["ran"] == [["accel_0", 0], ["accel_0", 2], ["accel_1", 1], ["accel_1", 3]]


def test_without_saturate_host_one_copy_runs_and_the_other_cores_stay_idle(report):
    single = report["False"]
    assert single["groups"] == [[0, 1]]
    assert single["loaded"] == {"0": {"accel_0": "CompiledSubgraph"}, "1": {"accel_1": "CompiledSubgraph"},
                                "2": {}, "3": {}}
    assert single["ran"] == [["accel_0", 0], ["accel_1", 1]]
