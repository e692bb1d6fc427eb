"""Library models served by `neuron-serve deploy`, checked with tritonclient against eager."""

import sys
from pathlib import Path

import pytest
import torch
import tritonclient.http as triton

sys.path.insert(0, str(Path(__file__).resolve().parent / "models"))
import zoo_served  # noqa: E402

TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def zoo_server(tmp_path_factory, server_factory):
    srv = server_factory(["tests/integration/models/gpt2.yaml", "tests/integration/models/lraspp.yaml",
                          "tests/integration/models/yolos.yaml"],
                         tmp_path_factory.mktemp("zoo"))
    yield srv
    srv.stop()


def _client(server) -> triton.InferenceServerClient:
    return triton.InferenceServerClient(server.url.removeprefix("http://"))


@pytest.mark.parametrize("binary", [False, True])
def test_gpt2_logits_equal_eager(zoo_server, binary):
    client = _client(zoo_server)
    assert client.is_model_ready("gpt2")
    ids = torch.randint(0, 100, (3, 16))  # 3 rows: two chunks of the trace batch of 2
    inp = triton.InferInput("input_ids", [3, 16], "INT64")
    inp.set_data_from_numpy(ids.numpy(), binary_data=binary)
    logits = torch.from_numpy(client.infer("gpt2", [inp]).as_numpy("logits").copy())
    with torch.no_grad():
        expected = zoo_served.gpt2()(ids).logits
    torch.testing.assert_close(logits, expected, atol=TOLERANCE, rtol=TOLERANCE)


def test_segmentation_masks_equal_eager(zoo_server):
    client = _client(zoo_server)
    meta = client.get_model_metadata("lraspp")
    assert meta["outputs"][0]["name"] == "out"
    images = torch.rand(2, 3, 64, 64)
    inp = triton.InferInput("images", [2, 3, 64, 64], "FP32")
    inp.set_data_from_numpy(images.numpy(), binary_data=True)
    out = torch.from_numpy(client.infer("lraspp", [inp]).as_numpy("out").copy())
    with torch.no_grad():
        expected = zoo_served.lraspp()(images)["out"]
    assert out.shape == (2, 3, 64, 64)
    torch.testing.assert_close(out, expected, atol=TOLERANCE, rtol=TOLERANCE)
    assert torch.equal(out.argmax(1), expected.argmax(1))


@pytest.mark.parametrize("binary", [False, True])
def test_detection_boxes_and_classes_equal_eager(zoo_server, binary):
    client = _client(zoo_server)
    meta = client.get_model_metadata("yolos")
    assert [o["name"] for o in meta["outputs"]] == ["logits", "pred_boxes", "last_hidden_state"]
    images = torch.rand(3, 3, 32, 32)  # 3 rows: two chunks of the trace batch of 2
    inp = triton.InferInput("pixel_values", [3, 3, 32, 32], "FP32")
    inp.set_data_from_numpy(images.numpy(), binary_data=binary)
    wanted = [triton.InferRequestedOutput(name, binary_data=binary) for name in ("logits", "pred_boxes")]
    result = client.infer("yolos", [inp], outputs=wanted)
    with torch.no_grad():
        expected = zoo_served.yolos()(images)
    logits = torch.from_numpy(result.as_numpy("logits").copy())
    boxes = torch.from_numpy(result.as_numpy("pred_boxes").copy())
    assert logits.shape == (3, 5, 4) and boxes.shape == (3, 5, 4)
    torch.testing.assert_close(logits, expected.logits, atol=TOLERANCE, rtol=TOLERANCE)
    torch.testing.assert_close(boxes, expected.pred_boxes, atol=TOLERANCE, rtol=TOLERANCE)
    assert torch.equal(logits.argmax(-1), expected.logits.argmax(-1))  # the class of each detection
