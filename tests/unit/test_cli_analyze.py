"""`neuron-serve analyze` on the shipped deployments, run as users run it."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _cli(*args, cwd=ROOT):
    return subprocess.run(
        [sys.executable, "-m", "neuron_serve.cli", *args], cwd=cwd, capture_output=True, text=True, timeout=300,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )


def test_analyze_prints_report_and_plan():
    result = _cli("analyze", "deployments/mlp.yaml")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["support_percentage"] == "85.71%"
    assert [(p["device"], p["op_counts"]) for p in report["partitions"]] == [
        ("neuron", {"aten::linear": 3, "aten::relu": 2, "aten::log_softmax": 1}),
        ("cpu", {"aten::sort": 1}),
    ]
    assert "85.71% of arithmetic operations (6 of 7) are supported" in result.stderr
    assert "Creating Partition #2 for device: Device.CPU" in result.stderr
    assert "emulating 1 NeuronCore(s) on XLA:CPU" in result.stderr


def test_analyze_writes_json(tmp_path):
    out = tmp_path / "report.json"
    result = _cli("analyze", "deployments/convnet.yaml", "--json", str(out))
    assert result.returncode == 0, result.stderr
    report = json.loads(out.read_text())
    assert report["support_percentage"] == "100.00%"
    assert [p["device"] for p in report["partitions"]] == ["neuron"]


@pytest.mark.parametrize(
    "text, message",
    [
        ("name: x\nmodel: {factory: nope}\ninputs: [{name: x, shape: [1]}]\n", "model.factory: String should match"),
        ("name: x\nmodel: {factory: a.b:c}\ninputs: [{name: x, shape: [1], dtype: float8}]\n", "inputs.0.dtype"),
        ("name: x\nmodel: {factory: a.b:c}\ninputs: [{name: x, shape: [0]}]\n", "inputs.0.shape"),
        ("name: x\nmodel: {factory: a.b:c}\ninputs: [{name: x, shape: [1]}]\ntargte: xla\n", "targte: Extra inputs"),
        ("name: x\nmodel: {factory: a.b:c}\ninputs: []\n", "inputs: List should have at least 1 item"),
        ("model: {factory: a.b:c}\ninputs: [{name: x, shape: [1]}]\n", "name: Field required (add it)"),
        ("name: x\nmodel: {factory: a.b:c}\ninputs: [{name: x, shape: [1]}]\npartitioner: {min_subgraph_size: 0}\n",
         "PartitionerConfig.min_subgraph_size"),
        ("name: x\nmodel: {factory: missing_mod:build}\ninputs: [{name: x, shape: [1]}]\n",
         "model.factory: cannot import 'missing_mod:build'"),
        ("name: [x\n", "not valid YAML"),
    ],
)
def test_bad_model_yaml_names_the_field(tmp_path, text, message):
    path = tmp_path / "model.yaml"
    path.write_text(text)
    result = _cli("analyze", str(path))
    assert result.returncode == 2, result.stderr
    assert message in result.stderr
    assert "Traceback" not in result.stderr
