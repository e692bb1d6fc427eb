"""One model over several emulated cores: the plan torch's partitioner makes and its refusals.
(tests/unit/runtime/test_pipelined_runner.py runs the compiled stages on their cores.)"""

import inspect
import json
import os
import subprocess
import sys

import pytest
import torch

from neuron_serve.errors import PartitionError
from neuron_serve.partition.pipeline import CORE_MEMORY_ENV, NEURON_CORE_MEMORY_BYTES, core_memory_bytes, plan_pipeline

# Each Linear(64, 64) holds 64*64*4 + 64*4 = 16640 bytes of weights plus a 1024-byte 4x64 output.
BUDGET = 40_000


class FourLayers(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(64, 64) for _ in range(4))

    def forward(self, x):
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return FourLayers().eval()


def test_over_budget_model_splits_into_two_stages_on_two_cores(model):
    plan = plan_pipeline(model, (torch.randn(4, 64),), cores=2, memory_bytes=BUDGET)
    assert [s.core for s in plan.stages] == [0, 1]
    assert [s.name for s in plan.stages] == ["submod_0", "submod_1"]
    assert all(s.memory_bytes <= BUDGET for s in plan.stages)
    # The second stage receives one 4x64 float32 activation from the first.
    assert plan.stages[1].bytes_in == 4 * 64 * 4


def test_model_that_fits_one_core_stays_one_stage(model):
    plan = plan_pipeline(model, (torch.randn(4, 64),), cores=2, memory_bytes=10**9)
    assert len(plan.stages) == 1


def test_total_too_big_is_refused_with_torchs_message(model):
    with pytest.raises(PartitionError) as e:
        plan_pipeline(model, (torch.randn(4, 64),), cores=2, memory_bytes=20_000)
    # 4 x (16640 weight bytes + 1024 activation bytes) + the 4x64 input = 75776 bytes.
    assert str(e.value) == ("Devices have no enough memory for the module (75776 bytes over 2 core(s) of "
                            "20000 bytes; largest node layers_0: 17664 bytes)")


def test_node_larger_than_a_core_is_refused_naming_it(model):
    with pytest.raises(PartitionError) as e:
        plan_pipeline(model, (torch.randn(4, 64),), cores=8, memory_bytes=10_000)
    assert str(e.value) == "layers_0 is too large to fit any device (17664 bytes; a core has 10000 bytes)"


def test_core_memory_is_16_gib_on_neuron_and_configurable_in_emulation(monkeypatch):
    monkeypatch.setenv(CORE_MEMORY_ENV, "12345")
    assert core_memory_bytes(emulated=False) == NEURON_CORE_MEMORY_BYTES == 16 * 2**30
    assert core_memory_bytes(emulated=True) == 12345
    monkeypatch.setenv(CORE_MEMORY_ENV, "lots")
    with pytest.raises(PartitionError, match="NEURON_SERVE_CORE_MEMORY_BYTES='lots' is not a whole number"):
        core_memory_bytes(emulated=True)


def test_unknown_mode_is_refused(model):
    with pytest.raises(PartitionError, match="placement mode 'sparse_nn' is not one of size_based, cost_aware, kl_based, latency"):
        plan_pipeline(model, (torch.randn(4, 64),), cores=2, mode="sparse_nn", memory_bytes=BUDGET)


# The factory module the CLI test's model.yaml names: FourLayers as defined above.
MODEL_PY = "import torch\n\n\n" + inspect.getsource(FourLayers) + "\n\ndef build():\n    return FourLayers()\n"

MODEL_YAML = """
name: four
model:
  factory: four_layers:build
inputs:
  - name: x
    shape: [4, 64]
    dtype: float32
"""


def _analyze(tmp_path, budget):
    (tmp_path / "four_layers.py").write_text(MODEL_PY)
    (tmp_path / "model.yaml").write_text(MODEL_YAML)
    env = {**os.environ, "PYTHONWARNINGS": "ignore", CORE_MEMORY_ENV: str(budget), "PJRT_DEVICE": "CPU"}
    return subprocess.run([sys.executable, "-m", "neuron_serve.cli", "analyze", "model.yaml", "--pipeline-cores", "2"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env)


def test_analyze_prints_the_pipeline_plan(tmp_path):
    result = _analyze(tmp_path, BUDGET)
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)["pipeline"]
    assert plan["mode"] == "size_based" and plan["core_memory_bytes"] == BUDGET
    assert [(s["name"], s["core"]) for s in plan["stages"]] == [("accel_0", 0), ("accel_1", 1)]
    assert plan["stages"][1]["bytes_in"] == 1024
    assert "pipeline (size_based) over 2 core(s), 40000 bytes per core:" in result.stderr


def test_analyze_refuses_a_model_that_fits_no_core(tmp_path):
    result = _analyze(tmp_path, 20_000)
    assert result.returncode == 3
    # analyze plans the captured ATen graph trace compiles, where a weight is a node of its own.
    assert ("error: Devices have no enough memory for the module (75776 bytes over 2 core(s) of 20000 bytes; "
            "largest node layers_0_weight: 16384 bytes)") in result.stderr


def test_a_node_with_several_outputs_is_refused_naming_it():
    class Sorts(torch.nn.Module):
        def forward(self, x):
            return torch.sort(x).values

    with pytest.raises(PartitionError) as e:
        plan_pipeline(Sorts(), (torch.randn(4, 64),), cores=2, memory_bytes=BUDGET)
    assert str(e.value) == ("pipeline placement needs every node to output one tensor (torch's partitioner sizes "
                            "nodes that way); sort (sort) does not")
