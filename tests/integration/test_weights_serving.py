"""A built weight-separated artifact serves a second checkpoint without compiling; a checkpoint that does not
fit is refused before anything starts."""

import os
import re
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
import torch
import tritonclient.http as triton
import yaml

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "integration" / "models"))
import tiny_mlp  # noqa: E402

TOLERANCE = 1e-5  # XLA:CPU and eager float32 matmuls differ only in summation order
ENV = {**os.environ, "PYTHONWARNINGS": "ignore"}
INPUTS = [{"name": "x", "shape": [4, 16], "dtype": "float32"}]


def _cli(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "neuron_serve.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env=ENV)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """The built artifact, checkpoints of the same architecture (and misfits), and a model.yaml serving one."""
    tmp = tmp_path_factory.mktemp("weights")
    built = _cli("build", "tests/integration/models/separated.yaml", "-o", str(tmp / "separated"))
    assert built.returncode == 0, built.stderr
    torch.save(tiny_mlp.build(seed=1).state_dict(), tmp / "second.pt")
    torch.save({**tiny_mlp.build(seed=1).state_dict(), "2.weight": torch.zeros(4, 33)}, tmp / "reshaped.pt")
    (tmp / "second.yaml").write_text(yaml.safe_dump({
        "name": "separated-second", "model": {"artifact": "separated"}, "weights": "second.pt", "inputs": INPUTS,
        "batching": {"max_batch_size": 4}}))
    (tmp / "reshaped.yaml").write_text(yaml.safe_dump({
        "name": "separated-reshaped", "model": {"artifact": "separated"}, "weights": "reshaped.pt", "inputs": INPUTS}))
    return tmp


@pytest.fixture(scope="module")
def server(files, server_factory):
    """The artifact as built and the artifact with the second checkpoint, side by side."""
    srv = server_factory([str(files / "separated"), str(files / "second.yaml")], files)
    yield srv
    srv.stop()


def _infer(server, model: str, x: torch.Tensor) -> torch.Tensor:
    client = triton.InferenceServerClient(server.url.removeprefix("http://"))
    inp = triton.InferInput("x", list(x.shape), "FP32")
    inp.set_data_from_numpy(x.numpy(), binary_data=True)
    return torch.from_numpy(client.infer(model, [inp]).as_numpy("output_0").copy())


def test_a_second_checkpoint_is_served_from_the_same_artifact(server):
    x = torch.rand(3, 16)
    first, second = tiny_mlp.build(seed=0)(x), tiny_mlp.build(seed=1)(x)
    assert not torch.allclose(first, second, atol=1e-2)  # the checkpoints answer differently
    torch.testing.assert_close(_infer(server, "separated", x), first, atol=TOLERANCE, rtol=0)
    torch.testing.assert_close(_infer(server, "separated-second", x), second, atol=TOLERANCE, rtol=0)


def test_the_second_checkpoint_compiled_nothing_more_than_loading_the_artifact(server):
    with urllib.request.urlopen(server.url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    compiles = {m: float(v) for m, v in re.findall(
        r'^neuron_serve_build_compiles_total\{[^}]*model="([\w-]+)"[^}]*\} (\S+)$', text, re.MULTILINE)}
    # One accelerator subgraph at the two compiled batch sizes (1 and 4): the artifact's load, with or without
    # the checkpoint (emulated cores cannot load serialized executables, so loading compiles them).
    assert compiles == {"separated": 2.0, "separated-second": 2.0}


def test_a_checkpoint_that_does_not_fit_is_refused_before_anything_starts(files):
    expected = (f"error: weights: {files / 'reshaped.pt'}: weight '2.weight' has shape (4, 33); the traced model "
                "has (4, 32). Give a checkpoint of the served architecture (torch.save(model.state_dict(), path) of "
                "the same model class and config), or remove 'weights' to serve the model's own.")
    refused = _cli("deploy", str(files / "reshaped.yaml"), timeout=120)
    assert refused.returncode == 2 and refused.stderr.strip().splitlines()[-1] == expected, refused.stderr
    flag = _cli("deploy", str(files / "separated"), "--weights", str(files / "reshaped.pt"), timeout=120)
    assert flag.returncode == 2 and flag.stderr.strip().splitlines()[-1] == expected, flag.stderr
    assert "Ray" not in refused.stderr + flag.stderr  # refused before Ray started
