"""`neuron-serve analyze` on the shipped deployments, run as users run it."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


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


def test_analyze_takes_the_model_yaml_partitioner_kwargs(tmp_path):
    # partitioner.analyze_parameters and trace_kwargs of model.yaml reach `neuron-serve analyze` and its report.
    config = tmp_path / "mlp.yaml"
    config.write_text(
        "name: mlp\nmodel: {factory: 'example_models.mlp:build', kwargs: {input_size: 16, layers: [8, 8]}}\n"
        "inputs: [{name: x, shape: [2, 16]}]\n"
        "partitioner:\n"
        "  trace_kwargs: {compiler_args: '--auto-cast matmult'}\n"
        "  analyze_parameters: {compiler_workdir: analysis, additional_ignored_ops: ['aten::relu'], max_workers: 2}\n"
    )
    result = _cli("analyze", str(config), "--report-json", str(tmp_path / "page.json"),
                  cwd=ROOT / "deployments")  # example_models importable from the working directory
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["support_percentage"] == "80.00%"  # 4 of 5: relu left out of the count, sort on CPU
    assert "aten::relu" not in report["supported_operators"]["aten"]
    assert json.loads((tmp_path / "analysis" / "analyze.json").read_text()) == {
        k: v for k, v in report.items() if k != "partitions"}
    page = json.loads((tmp_path / "page.json").read_text())
    assert page["compiler_args"]["argv"] == ["--auto-cast", "matmult"]
