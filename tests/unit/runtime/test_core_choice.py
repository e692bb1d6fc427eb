"""Which core a chunk runs on: a lone request keeps to the core that ran last while it is idle (its
copy of the weights is the one in cache); chunks that run together spread over the idle cores. In a
subprocess: two emulated cores need CPU_NUM_DEVICES=2 before torch_xla starts."""

import json
import os
import subprocess
import sys

import pytest

RUN = """
import asyncio, json, torch
import neuron_serve
from neuron_serve.runtime.observer import RuntimeObserver
from neuron_serve.runtime.runner import ModelRunner

class Chunks(RuntimeObserver, list):
    def chunk(self, core, size, padded):
        self.append(core)

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)).eval()
traced = neuron_serve.dynamic_batch(neuron_serve.trace(model, torch.randn(4, 16), batch_sizes=[4]))
chunks = Chunks()
runner = ModelRunner(traced, cores=2, observer=chunks)
report = {}

async def one_after_another():
    for _ in range(6):
        x = torch.randn(2, 16)
        [[out]] = await runner.infer([[x]])
        torch.testing.assert_close(out, model(x), rtol=1e-5, atol=1e-5)

async def together(count):
    xs = [torch.randn(4, 16) for _ in range(count)]
    outs = await asyncio.gather(*(runner.infer([[x]]) for x in xs))
    for [[out]], x in zip(outs, xs):
        torch.testing.assert_close(out, model(x), rtol=1e-5, atol=1e-5)

with torch.no_grad():
    asyncio.run(one_after_another())
    report["alone"], chunks[:] = list(chunks), []
    asyncio.run(together(2))
    report["two together"], chunks[:] = list(chunks), []
    asyncio.run(one_after_another())
    report["alone again"], chunks[:] = list(chunks), []
runner.close()
print(json.dumps(report))
"""


@pytest.fixture(scope="module")
def report():
    env = {**os.environ, "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "2", "PYTHONWARNINGS": "ignore"}
    result = subprocess.run([sys.executable, "-c", RUN], capture_output=True, text=True, timeout=600, env=env)
    # The subprocess asserts every output equals eager within rtol=atol=1e-5.
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.splitlines()[-1])


def test_requests_one_after_another_keep_to_one_core(report):
    assert len(report["alone"]) == 6 and len(set(report["alone"])) == 1


def test_chunks_running_together_take_both_cores(report):
    assert sorted(report["two together"]) == [0, 1]


def test_a_lone_request_after_a_burst_stays_on_the_core_that_ran_last(report):
    assert len(set(report["alone again"])) == 1
    assert report["alone again"][0] == report["two together"][-1]
