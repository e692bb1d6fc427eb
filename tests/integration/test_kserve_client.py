"""The served models through KServe's Python client (InferenceRESTClient, protocol v2).

kserve cannot be installed next to Ray (it pins protobuf<7), so the client runs as
kserve_calls.py under .venv-kserve's python, which `make test` installs; the eager
references are computed here, in the test venv.
"""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
KSERVE_PYTHON = ROOT / ".venv-kserve" / "bin" / "python"
SCRIPT = Path(__file__).with_name("kserve_calls.py")
sys.path.insert(0, str(ROOT / "deployments"))
from example_models import encoder, mlp  # noqa: E402

TOLERANCE = 1e-5  # the same bounds as test_serving.py: XLA:CPU vs eager float32
ENCODER_TOLERANCE = 1e-4


@pytest.fixture(scope="session")
def kserve_python() -> Path:
    """.venv-kserve's python; `make kserve-client` builds it when only pytest was run."""
    if not (ROOT / ".venv-kserve" / ".installed").exists():
        subprocess.run(["make", "-s", "kserve-client"], cwd=ROOT, check=True)
    return KSERVE_PYTHON


@pytest.fixture(scope="module")
def models():
    return {"mlp": mlp.build(), "encoder": encoder.build(layers=4, hidden=256)}


def kserve(kserve_python, server, workdir: Path, calls: list[dict], grpc: bool = False) -> list[dict]:
    done = subprocess.run(
        [str(kserve_python), str(SCRIPT), server.grpc_url if grpc else server.url, str(workdir)],
        input=json.dumps(calls), capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_health_through_the_kserve_client(kserve_python, server, tmp_path):
    calls = [{"op": "live"}, {"op": "ready"}, {"op": "model_ready", "model": "mlp"}, {"op": "model_ready", "model": "nope"}]
    assert kserve(kserve_python, server, tmp_path, calls) == [{"value": True}, {"value": True}, {"value": True}, {"value": False}]


@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
def test_kserve_client_infer_matches_eager(kserve_python, server, models, tmp_path, binary):
    x = torch.rand(3, 784)
    ids = torch.randint(0, 1000, (2, 40))
    mask = torch.ones(2, 40, dtype=torch.int64)
    np.savez(tmp_path / "mlp.npz", x=x.numpy())
    np.savez(tmp_path / "encoder.npz", input_ids=ids.numpy(), attention_mask=mask.numpy())
    calls = [
        {"op": "infer", "model": "mlp", "inputs": "mlp.npz", "binary": binary, "out": "mlp-out.npz"},
        {"op": "infer", "model": "encoder", "inputs": "encoder.npz", "binary": binary, "out": "encoder-out.npz"},
    ]
    mlp_result, encoder_result = kserve(kserve_python, server, tmp_path, calls)

    assert mlp_result == {"outputs": {"output_0": {"datatype": "FP32", "shape": [3, 10]}}, "binary_reply": binary}
    assert encoder_result["binary_reply"] is binary
    with np.load(tmp_path / "mlp-out.npz") as out:
        torch.testing.assert_close(torch.from_numpy(out["output_0"]), models["mlp"](x), atol=TOLERANCE, rtol=TOLERANCE)

    assert encoder_result["outputs"]["last_hidden_state"] == {"datatype": "FP32", "shape": [2, 40, 256]}
    ref = models["encoder"](ids, mask)
    with np.load(tmp_path / "encoder-out.npz") as out:
        for name in ("last_hidden_state", "pooler_output"):
            torch.testing.assert_close(
                torch.from_numpy(out[name]), getattr(ref, name), atol=ENCODER_TOLERANCE, rtol=ENCODER_TOLERANCE
            )


def test_kserve_client_reports_errors_with_status_and_message(kserve_python, server, tmp_path):
    np.savez(tmp_path / "good.npz", x=np.zeros((1, 784), np.float32))
    np.savez(tmp_path / "wrong-dtype.npz", x=np.zeros((1, 784), np.int64))
    calls = [
        {"op": "infer", "model": "nope", "inputs": "good.npz", "binary": False, "out": "unused.npz"},
        {"op": "infer", "model": "mlp", "inputs": "wrong-dtype.npz", "binary": True, "out": "unused.npz"},
    ]
    unknown, bad_dtype = (r["error"] for r in kserve(kserve_python, server, tmp_path, calls))
    # KServe's client raises httpx.HTTPStatusError carrying the server's {"error": ...} text.
    assert unknown["type"] == "HTTPStatusError" and unknown["status"] == 404
    assert unknown["message"].startswith("model 'nope' not found, '404 Not Found' for url")
    assert bad_dtype["type"] == "HTTPStatusError" and bad_dtype["status"] == 400
    assert "FP32" in bad_dtype["message"] and "'400 Bad Request'" in bad_dtype["message"]


# -- gRPC: KServe's InferenceGRPCClient ------------------------------------------------------


@pytest.mark.parametrize("raw", [False, True], ids=["typed-contents", "raw-contents"])
def test_kserve_grpc_client_infer_matches_eager(kserve_python, server, models, tmp_path, raw):
    x = torch.rand(3, 784)
    ids = torch.randint(0, 1000, (2, 40))
    mask = torch.ones(2, 40, dtype=torch.int64)
    np.savez(tmp_path / "mlp.npz", x=x.numpy())
    np.savez(tmp_path / "encoder.npz", input_ids=ids.numpy(), attention_mask=mask.numpy())
    calls = [
        {"op": "live"}, {"op": "ready"}, {"op": "model_ready", "model": "mlp"},
        {"op": "infer", "model": "mlp", "inputs": "mlp.npz", "binary": raw, "out": "mlp-out.npz"},
        {"op": "infer", "model": "encoder", "inputs": "encoder.npz", "binary": raw, "out": "encoder-out.npz"},
    ]
    live, ready, model_ready, mlp_result, encoder_result = kserve(kserve_python, server, tmp_path, calls, grpc=True)
    assert live == ready == model_ready == {"value": True}
    assert mlp_result == {"outputs": {"output_0": {"datatype": "FP32", "shape": [3, 10]}}}
    with np.load(tmp_path / "mlp-out.npz") as out:
        torch.testing.assert_close(torch.from_numpy(out["output_0"]), models["mlp"](x), atol=TOLERANCE, rtol=TOLERANCE)
    assert encoder_result["outputs"]["last_hidden_state"] == {"datatype": "FP32", "shape": [2, 40, 256]}
    ref = models["encoder"](ids, mask)
    with np.load(tmp_path / "encoder-out.npz") as out:
        for name in ("last_hidden_state", "pooler_output"):
            torch.testing.assert_close(
                torch.from_numpy(out[name]), getattr(ref, name), atol=ENCODER_TOLERANCE, rtol=ENCODER_TOLERANCE
            )


def test_kserve_grpc_client_reports_status_codes_and_messages(kserve_python, server, tmp_path):
    np.savez(tmp_path / "good.npz", x=np.zeros((1, 784), np.float32))
    np.savez(tmp_path / "wrong-dtype.npz", x=np.zeros((1, 784), np.int64))
    calls = [
        {"op": "infer", "model": "nope", "inputs": "good.npz", "binary": True, "out": "unused.npz"},
        {"op": "infer", "model": "mlp", "inputs": "wrong-dtype.npz", "binary": False, "out": "unused.npz"},
    ]
    unknown, bad_dtype = (r["error"] for r in kserve(kserve_python, server, tmp_path, calls, grpc=True))
    assert unknown == {"type": "AioRpcError", "status": "NOT_FOUND", "message": "model 'nope' not found"}
    assert bad_dtype == {"type": "AioRpcError", "status": "INVALID_ARGUMENT",
                         "message": "input 'x' has datatype INT64; expected FP32"}
