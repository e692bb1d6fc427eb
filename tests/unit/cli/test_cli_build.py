"""`neuron-serve build model.yaml -o DIR`, and serving the artifact it writes."""

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from neuron_serve.assembly.from_config import build
from neuron_serve.config.factory import build_model
from neuron_serve.config.schema import load_config, load_deployment
from neuron_serve.errors import ArtifactError, ConfigError
from neuron_serve.runtime.runner import ModelRunner

ROOT = Path(__file__).resolve().parents[3]
TOLERANCE = 1e-4


def _cli(*args, cache):
    return subprocess.run(
        [sys.executable, "-m", "neuron_serve.cli", "--cache-dir", str(cache), *args], cwd=ROOT, capture_output=True,
        text=True, timeout=300, env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("build")
    result = _cli("build", "deployments/mlp.yaml", "-o", str(tmp / "mlp"), cache=tmp / "cache")
    assert result.returncode == 0, result.stderr
    return tmp, result


def test_build_prints_a_line_per_compiled_model_and_the_placement_and_writes_a_deployable_artifact(built):
    tmp, result = built
    for index, size in enumerate((1, 4, 16, 32, 64), 1):  # deployments/mlp.yaml's batch_sizes
        assert f"neuron_serve: compiled mlp batch {size} ({index} of 5) in " in result.stderr
    assert ("neuron_serve: placement of mlp (5 compiled models): 5 accelerator subgraphs, 5 CPU subgraphs; "
            "operators: 30 on the accelerator, 5 on CPU (aten::sort); --verbose lists them\n") in result.stderr
    assert "Num Partitions" not in result.stderr and "aten::linear" not in result.stderr  # those are for -v
    assert f"-> {tmp / 'mlp'} (serve it: neuron-serve deploy {tmp / 'mlp'})" in result.stderr
    served = yaml.safe_load((tmp / "mlp" / "model.yaml").read_text())
    assert served["model"] == {"artifact": "."} and served["name"] == "mlp" and served["cores_per_replica"] == 2
    assert any((tmp / "cache" / "support").rglob("*.json"))  # --cache-dir was used


def test_the_artifact_serves_results_equal_to_eager(built):
    tmp, _ = built
    config, base_dir = load_deployment(tmp / "mlp")
    assert base_dir == str((tmp / "mlp").resolve())
    runner = ModelRunner(build(config, base_dir), cores=1)  # this process has 1 core
    try:
        eager = build_model(load_config(ROOT / "deployments/mlp.yaml"), ROOT / "deployments")
        requests = [[torch.rand(rows, 784)] for rows in (1, 7, 40)]
        results = asyncio.run(runner.infer(requests))
        for (x,), (out,) in zip(requests, results):
            torch.testing.assert_close(out, eager(x), atol=TOLERANCE, rtol=TOLERANCE)
        assert [p["device"] for p in runner.partitions] == ["neuron", "cpu"]
    finally:
        runner.close()


def test_an_artifact_with_other_inputs_than_its_model_yaml_is_refused(built, tmp_path):
    tmp, _ = built
    data = yaml.safe_load((tmp / "mlp" / "model.yaml").read_text())
    data["model"] = {"artifact": str(tmp / "mlp")}
    data["inputs"][0]["dtype"] = "float16"
    (tmp_path / "model.yaml").write_text(yaml.safe_dump(data))
    config, base_dir = load_deployment(tmp_path / "model.yaml")
    with pytest.raises(ArtifactError, match="was built for inputs .* but this model.yaml declares .*rebuild the artifact"):
        build(config, base_dir)


def test_deploy_refuses_a_directory_that_is_no_artifact(tmp_path):
    with pytest.raises(ConfigError, match="must be an artifact written by 'neuron-serve build'"):
        load_deployment(tmp_path)


def test_model_source_is_a_factory_or_an_artifact(tmp_path):
    data = yaml.safe_load((ROOT / "deployments/mlp.yaml").read_text())
    data["model"]["artifact"] = "build/mlp"
    (tmp_path / "model.yaml").write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError, match="model: Value error, give exactly one of 'factory'"):
        load_config(tmp_path / "model.yaml")


def test_build_refuses_a_model_yaml_that_names_an_artifact(built):
    tmp, _ = built
    result = _cli("build", str(tmp / "mlp" / "model.yaml"), "-o", str(tmp / "again"), cache=tmp / "cache")
    assert result.returncode == 2 and "already names an artifact" in result.stderr


def test_an_artifact_built_for_other_shapes_is_refused_with_both_listed(built, tmp_path):
    tmp, _ = built
    data = yaml.safe_load((tmp / "mlp" / "model.yaml").read_text())
    data["model"] = {"artifact": str(tmp / "mlp")}
    data["inputs"][0]["shape"] = [1, 100]
    (tmp_path / "model.yaml").write_text(yaml.safe_dump(data))
    config, base_dir = load_deployment(tmp_path / "model.yaml")
    with pytest.raises(ArtifactError) as refused:
        build(config, base_dir)
    assert str(refused.value) == (
        f"model.artifact: {tmp / 'mlp'} was built for inputs [([-1, 784], 'torch.float32')] (-1: any size), but "
        f"this model.yaml declares [('x', [1, 100], 'float32')]; rebuild the artifact from this model.yaml."
    )
