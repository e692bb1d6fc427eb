"""`neuron-serve build` ahead of time, then `neuron-serve deploy DIR` serves the artifact."""

import os
import subprocess
import sys

import pytest
import torch
import tritonclient.http as triton

ROOT = __import__("pathlib").Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "deployments"))
from example_models import convnet  # noqa: E402

TOLERANCE = 1e-4  # XLA:CPU convolutions reassociate float sums


@pytest.fixture(scope="module")
def artifact_server(tmp_path_factory, server_factory):
    tmp = tmp_path_factory.mktemp("artifact")
    built = subprocess.run(
        [sys.executable, "-m", "neuron_serve.cli", "build", "deployments/convnet.yaml", "-o", str(tmp / "convnet")],
        cwd=ROOT, capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    assert built.returncode == 0, built.stderr
    srv = server_factory([str(tmp / "convnet")], tmp)
    yield srv
    srv.stop()


def test_deploying_an_artifact_serves_results_equal_to_eager(artifact_server):
    c = triton.InferenceServerClient(artifact_server.url.removeprefix("http://"))
    assert c.is_model_ready("convnet")
    meta = c.get_model_metadata("convnet")
    assert meta["inputs"] == [{"name": "pixel_values", "datatype": "FP32", "shape": [-1, 3, 64, 64]}]
    model = convnet.build()
    x = torch.rand(3, 3, 64, 64)
    inp = triton.InferInput("pixel_values", [3, 3, 64, 64], "FP32")
    inp.set_data_from_numpy(x.numpy(), binary_data=True)
    logits = torch.from_numpy(c.infer("convnet", [inp]).as_numpy("logits").copy())
    torch.testing.assert_close(logits, model(x).logits, atol=TOLERANCE, rtol=TOLERANCE)
