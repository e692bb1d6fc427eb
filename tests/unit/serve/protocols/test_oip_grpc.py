"""The OIP v2 gRPC codec (neuron_serve.serve.protocols.oip_grpc): ModelInferRequest to
tensors and tensors to ModelInferResponse, checked against tritonclient's own messages,
with the exact messages a client reads for each mistake."""

import tracemalloc

import numpy as np
import pytest
import torch
import tritonclient.grpc as tgrpc
from tritonclient.grpc import service_pb2 as pb

from neuron_serve.errors import InvalidInput
from neuron_serve.serve.protocols import oip_grpc
from neuron_serve.serve.protocols.infer import InferOutput, InferResponse

RAW_DATATYPES = {"BOOL": np.bool_, "UINT8": np.uint8, "INT8": np.int8, "INT16": np.int16, "INT32": np.int32,
                 "INT64": np.int64, "FP16": np.float16, "FP32": np.float32, "FP64": np.float64}


def triton_request(inputs, outputs=(), request_id=""):
    """The message tritonclient.grpc sends for ``inputs`` (raw_input_contents)."""
    request = pb.ModelInferRequest(model_name="m", id=request_id)
    for name, array, datatype in inputs:
        tensor = tgrpc.InferInput(name, list(array.shape), datatype)
        tensor.set_data_from_numpy(array)
        request.inputs.extend([tensor._get_tensor()])
        request.raw_input_contents.extend([tensor._get_content()])
    for name in outputs:
        request.outputs.extend([tgrpc.InferRequestedOutput(name)._get_tensor()])
    return request


def typed(values, datatype="FP32", shape=(2, 2), field="fp32_contents"):
    request = pb.ModelInferRequest(model_name="m")
    tensor = request.inputs.add(name="x", datatype=datatype, shape=list(shape))
    getattr(tensor.contents, field).extend(values)
    return request


def refused(request, **kwargs) -> str:
    with pytest.raises(InvalidInput) as err:
        oip_grpc.decode_request(request, **kwargs)
    return str(err.value)


@pytest.mark.parametrize("datatype", sorted(RAW_DATATYPES))
def test_raw_contents_decode_to_the_client_array(datatype):
    array = (np.arange(12).reshape(3, 4) % 2).astype(RAW_DATATYPES[datatype])
    decoded = oip_grpc.decode_request(triton_request([("x", array, datatype)], request_id="r1"))
    (inp,) = decoded.inputs
    assert (decoded.id, inp.name, inp.datatype, inp.shape) == ("r1", "x", datatype, (3, 4))
    np.testing.assert_array_equal(inp.tensor.numpy(), array)


def test_raw_contents_are_viewed_not_copied():
    # The message hands out its bytes once (protobuf copies them out of its arena);
    # the tensor is a view of them, not another copy, and no JSON form is built.
    request = triton_request([("x", np.ones((1024, 1024), np.float32), "FP32")])  # 4 MiB
    tracemalloc.start()
    try:
        inp = oip_grpc.decode_request(request, max_elements=1 << 21).inputs[0]
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert inp.tensor.shape == (1024, 1024) and float(inp.tensor.sum()) == 1024 * 1024
    assert peak < 1.25 * 4 * 2 ** 20


def test_bf16_raw_contents_keep_their_bits():
    values = torch.tensor([[1.5, -2.25, 3e38]], dtype=torch.bfloat16)
    request = pb.ModelInferRequest(model_name="m")
    request.inputs.add(name="x", datatype="BF16", shape=[1, 3])
    request.raw_input_contents.append(values.view(torch.int16).numpy().tobytes())
    assert torch.equal(oip_grpc.decode_request(request).inputs[0].tensor, values)


def test_typed_contents_decode_and_outputs_are_asked_in_raw():
    request = typed([0.5, 1.5, 2.5, 3.5])
    request.outputs.add(name="y")
    decoded = oip_grpc.decode_request(request)
    assert decoded.inputs[0].tensor.tolist() == [[0.5, 1.5], [2.5, 3.5]]
    assert [(o.name, o.binary_data) for o in decoded.outputs] == [("y", True)]


def test_response_carries_raw_outputs_tritonclient_reads():
    out = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    message = oip_grpc.encode_response(InferResponse("m", "1", "r1", [InferOutput("y", "FP32", out)]))
    result = tgrpc.InferResult(message)
    assert (message.id, message.model_version, list(message.outputs[0].shape)) == ("r1", "1", [2, 3])
    np.testing.assert_array_equal(result.as_numpy("y"), out.numpy())


@pytest.mark.parametrize("request_, text", [
    (typed([0.5] * 3), "input 'x': contents.fp32_contents has 3 values but shape [2, 2] needs 4"),
    (typed([1] * 4, field="int_contents"), "input 'x': FP32 data goes in contents.fp32_contents, not contents.int_contents"),
    (typed([0.5] * 4, datatype="FP16"), "input 'x': FP16 has no typed contents field; send it in raw_input_contents"),
    (typed([300] * 4, datatype="INT8", field="int_contents"),
     "input 'x': element 0 = 300 (a number) is out of range for INT8 [-128, 127]"),
    (typed([0.5] * 4, datatype="FP99"),
     "input 'x': unknown datatype 'FP99'; use one of BOOL, UINT8, INT8, INT16, INT32, INT64, FP16, FP32, FP64, BF16"),
    (typed([1] * 4, datatype="UINT32", field="uint_contents"),
     "input 'x': datatype UINT32 is not supported; use one of BOOL, UINT8, INT8, INT16, INT32, INT64, FP16, FP32, "
     "FP64, BF16"),
    (typed([0.5] * 4, shape=(2, -2)),
     "input 'x': shape dimension 1 is -2 (a number); dimensions must be non-negative integers"),
])
def test_typed_contents_mistakes_are_named(request_, text):
    assert refused(request_) == text


def test_raw_contents_mistakes_are_named():
    request = triton_request([("x", np.zeros((2, 2), np.float32), "FP32")])
    request.raw_input_contents[0] = request.raw_input_contents[0][:-1]
    assert refused(request) == "input 'x': raw_input_contents holds 15 bytes but shape [2, 2] of FP32 needs 16 bytes"
    request.raw_input_contents.append(b"")
    assert refused(request) == ("raw_input_contents has 2 entries for 1 inputs; give one per input, "
                                "in the order of 'inputs'")
    both = triton_request([("x", np.zeros((2, 2), np.float32), "FP32")])
    both.inputs[0].contents.fp32_contents.extend([0.0] * 4)
    assert refused(both) == ("input 'x': data is in both contents and raw_input_contents; "
                             "give it in one of them")
    flags = triton_request([("x", np.zeros(3, np.bool_), "BOOL")])
    flags.raw_input_contents[0] = b"\x00\x01\x07"
    assert refused(flags) == "input 'x': BOOL binary data must be bytes 0 or 1; byte 2 is 7"


def test_request_level_mistakes_are_named_as_the_rest_schema_names_them():
    request = triton_request([("x", np.zeros((1, 2), np.float32), "FP32")], outputs=["y", "y"])
    assert refused(request) == "duplicate requested output 'y'"
    request = triton_request([("x", np.zeros((1, 2), np.float32), "FP32")] * 2)
    assert refused(request) == "duplicate input name 'x'"
    request.inputs[0].name = ""
    assert refused(request) == "inputs[0].name must not be empty"
    request = triton_request([("x", np.zeros((1, 2), np.float32), "FP32")], request_id="i" * 1025)
    assert refused(request) == "id has 1025 characters, more than 1024"
    request = triton_request([("x", np.zeros((1, 2), np.float32), "FP32")])
    request.outputs.add(name="")
    assert refused(request) == "outputs[0].name must not be empty"


def test_huge_shape_is_refused_before_anything_is_allocated():
    request = typed([], shape=(2 ** 40, 8))
    assert refused(request, max_elements=1024) == (
        "input 'x': shape [1099511627776, 8] has more than max_elements=1024 elements, the most one input of "
        "this model holds; send fewer rows per request")
