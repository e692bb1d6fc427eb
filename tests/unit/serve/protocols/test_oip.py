"""The Open Inference Protocol v2 REST codec, checked against tritonclient's own encoder
and decoder (JSON and the binary tensor data extension)."""

import json
import tracemalloc
from math import prod

import numpy as np
import pytest
import torch
import tritonclient.http as httpclient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tritonclient.utils import triton_to_np_dtype

from neuron_serve.errors import ConfigError, InvalidInput, NeuronServeError
from neuron_serve.serve.protocols import oip_rest
from neuron_serve.serve.protocols.oip_rest import (
    DATATYPE_TO_TORCH,
    TORCH_TO_DATATYPE,
    InferInput,
    TensorSpec,
    check_inputs,
    encode_infer_response,
    parse_infer_request,
)
from neuron_serve.serve.protocols.infer import datatype_itemsize

DATATYPES = ["BOOL", "UINT8", "INT8", "INT16", "INT32", "INT64", "FP16", "FP32", "FP64", "BF16"]
HLEN = "Inference-Header-Content-Length"


# --- helpers ---------------------------------------------------------------------------


def sample(datatype: str, shape=(2, 3, 4)) -> torch.Tensor:
    """A deterministic tensor with the datatype's awkward values in it."""
    g = torch.Generator().manual_seed(7)
    dtype = DATATYPE_TO_TORCH[datatype]
    if datatype == "BOOL":
        return torch.rand(shape, generator=g) > 0.5
    if dtype.is_floating_point:
        t = (torch.randn(shape, generator=g, dtype=torch.float64) * 100).to(dtype)
        flat = t.view(-1)
        if flat.numel() >= 4:
            flat[:4] = torch.tensor([float("nan"), float("inf"), float("-inf"), -0.0])
        return t
    info = torch.iinfo(dtype)
    t = torch.randint(max(info.min, -1000), min(info.max, 1000), shape, generator=g, dtype=dtype)
    if t.numel() >= 2:
        t.view(-1)[:2] = torch.tensor([info.min, info.max], dtype=dtype)
    return t


def to_numpy(t: torch.Tensor) -> np.ndarray:
    if t.dtype is torch.bfloat16:  # numpy has no bfloat16; tritonclient uses ml_dtypes
        return t.view(torch.int16).numpy().view(triton_to_np_dtype("BF16"))
    return t.numpy()


def from_numpy(a: np.ndarray, datatype: str) -> torch.Tensor:
    a = np.array(a, copy=True)  # writable and contiguous; keeps 0-d arrays 0-d
    if datatype == "BF16":
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)


def assert_same(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape
    torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


def triton_body(inputs, outputs=None, **kwargs):
    """A request body and headers exactly as tritonclient's HTTP client sends them."""
    body, header_length = httpclient.InferenceServerClient.generate_request_body(
        inputs, outputs=outputs, **kwargs
    )
    headers = {} if header_length is None else {HLEN: str(header_length)}
    return body, headers


def triton_input(name, tensor, binary):
    datatype = TORCH_TO_DATATYPE[tensor.dtype]
    inp = httpclient.InferInput(name, list(tensor.shape), datatype)
    inp.set_data_from_numpy(to_numpy(tensor), binary_data=binary)
    return inp


def decode(body: bytes, headers: dict):
    length = headers.get(HLEN)
    return httpclient.InferResult.from_response_body(
        body, verbose=False, header_length=None if length is None else int(length)
    )


def json_body(doc) -> bytes:
    return json.dumps(doc).encode()


def one_input(**fields) -> bytes:
    entry = {"name": "x", "shape": [3], "datatype": "FP32", "data": [1.0, 2.0, 3.0]}
    entry.update(fields)
    return json_body({"inputs": [{k: v for k, v in entry.items() if v is not ...}]})


def with_binary(doc, tail: bytes, header_length=None):
    header = json_body(doc)
    n = len(header) if header_length is None else header_length
    return header + tail, {HLEN: str(n)}


# --- datatypes -------------------------------------------------------------------------


def test_datatype_tables_are_inverse_and_complete():
    assert list(DATATYPE_TO_TORCH) == DATATYPES
    assert all(TORCH_TO_DATATYPE[dtype] == name for name, dtype in DATATYPE_TO_TORCH.items())


# --- round trips through tritonclient -------------------------------------------------


@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
@pytest.mark.parametrize("datatype", DATATYPES)
def test_request_from_tritonclient_parses_to_same_tensor(datatype, binary):
    original = sample(datatype)
    if datatype == "BF16" and not binary:
        # tritonclient refuses BF16 in JSON; a JSON client sends plain floats.
        body = one_input(shape=[2, 3, 4], datatype="BF16", data=original.float().tolist())
        headers = {}
    else:
        body, headers = triton_body([triton_input("x", original, binary)], request_id="r1")
    request = parse_infer_request(body, headers)
    (parsed,) = request.inputs
    assert (parsed.name, parsed.datatype, parsed.shape) == ("x", datatype, (2, 3, 4))
    assert parsed.tensor.device.type == "cpu"
    assert_same(parsed.tensor, original)


@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
@pytest.mark.parametrize("datatype", DATATYPES)
def test_response_decodes_in_tritonclient_to_same_tensor(datatype, binary):
    original = sample(datatype)
    request = parse_infer_request(
        json_body({"inputs": [], "parameters": {"binary_data_output": binary}}), {}
    )
    body, headers = encode_infer_response(
        model_name="m",
        model_version="1",
        request_id="r1",
        outputs=[("y", original)],
        request=request,
    )
    result = decode(body, headers)
    assert result.get_response()["model_name"] == "m"
    assert result.get_response()["id"] == "r1"
    output = result.get_output("y")
    assert output["datatype"] == datatype and output["shape"] == [2, 3, 4]
    assert ("parameters" in output) is binary and ("data" in output) is not binary
    assert_same(from_numpy(result.as_numpy("y"), datatype).to(original.dtype), original)


@pytest.mark.parametrize("datatype", DATATYPES)
@pytest.mark.parametrize("shape", [(), (0,), (0, 3), (1, 1, 5)], ids=str)
def test_odd_shapes_round_trip_in_binary(datatype, shape):
    original = sample(datatype, shape)
    body, headers = triton_body([triton_input("x", original, True)])
    request = parse_infer_request(body, headers)
    assert_same(request.inputs[0].tensor, original)
    body, headers = encode_infer_response(
        model_name="m",
        model_version=None,
        request_id=None,
        outputs=[("y", request.inputs[0].tensor)],
        request=request,
    )
    assert_same(from_numpy(decode(body, headers).as_numpy("y"), datatype), original)


def test_mixed_request_with_requested_outputs():
    a, b, c = sample("FP32"), sample("INT64", (5,)), sample("BOOL", (2, 2))
    outputs = [
        httpclient.InferRequestedOutput("second", binary_data=False),
        httpclient.InferRequestedOutput("first", binary_data=True),
    ]
    body, headers = triton_body(
        [triton_input("a", a, True), triton_input("b", b, False), triton_input("c", c, True)],
        outputs=outputs,
        request_id="req-9",
        parameters={"custom": 3},
    )
    request = parse_infer_request(body, headers)
    assert request.id == "req-9" and request.parameters == {"custom": 3}
    assert [i.name for i in request.inputs] == ["a", "b", "c"]
    for parsed, original in zip(request.inputs, (a, b, c), strict=True):
        assert_same(parsed.tensor, original)
    assert not request.binary_output
    assert [(o.name, o.binary_data) for o in request.outputs] == [
        ("second", False),
        ("first", True),
    ]

    first, second, unused = torch.arange(6.0).reshape(2, 3), torch.tensor([1, 2]), torch.ones(1)
    body, headers = encode_infer_response(
        model_name="m",
        model_version=None,
        request_id=request.id,
        outputs=[("first", first), ("unused", unused), ("second", second)],
        request=request,
    )
    assert headers["Content-Type"] == "application/octet-stream"
    result = decode(body, headers)
    response = result.get_response()
    assert [o["name"] for o in response["outputs"]] == ["second", "first"]
    assert response["outputs"][0]["data"] == [1, 2]
    assert response["outputs"][1]["parameters"] == {"binary_data_size": 24}
    assert "model_version" not in response and response["id"] == "req-9"
    np.testing.assert_array_equal(result.as_numpy("first"), first.numpy())
    np.testing.assert_array_equal(result.as_numpy("second"), second.numpy())


def test_no_requested_outputs_means_all_outputs_in_binary():
    # tritonclient sets binary_data_output when it names no outputs.
    body, headers = triton_body([triton_input("x", sample("FP32"), False)])
    assert headers == {}
    request = parse_infer_request(body, headers)
    assert request.outputs is None and request.binary_output
    body, headers = encode_infer_response(
        model_name="m",
        model_version="2",
        request_id=None,
        outputs=[("p", torch.ones(2)), ("q", torch.zeros(3, dtype=torch.int32))],
        request=request,
    )
    response = decode(body, headers).get_response()
    assert [o["parameters"]["binary_data_size"] for o in response["outputs"]] == [8, 12]
    assert int(headers[HLEN]) < len(body)


def test_json_response_is_flat_and_plain_json():
    request = parse_infer_request(one_input(), {})
    t = torch.tensor([[0.5, 1.5], [2.5, -1.0]], dtype=torch.float16)
    body, headers = encode_infer_response(
        model_name="m",
        model_version=None,
        request_id=None,
        outputs=[("y", t)],
        request=request,
    )
    assert headers == {"Content-Type": "application/json"}
    doc = json.loads(body)
    assert doc == {
        "model_name": "m",
        "outputs": [
            {"name": "y", "datatype": "FP16", "shape": [2, 2], "data": [0.5, 1.5, 2.5, -1.0]}
        ],
    }


def test_per_output_binary_false_overrides_request_default():
    doc = {
        "inputs": [],
        "parameters": {"binary_data_output": True},
        "outputs": [{"name": "y", "parameters": {"binary_data": False}}],
    }
    request = parse_infer_request(json_body(doc), {})
    body, headers = encode_infer_response(
        model_name="m",
        model_version=None,
        request_id=None,
        outputs=[("y", torch.ones(1))],
        request=request,
    )
    assert headers == {"Content-Type": "application/json"}
    assert json.loads(body)["outputs"][0]["data"] == [1.0]


def test_unknown_requested_output_is_invalid_input():
    request = parse_infer_request(json_body({"inputs": [], "outputs": [{"name": "nope"}]}), {})
    with pytest.raises(InvalidInput, match=r"requested output 'nope' .* outputs are: y"):
        encode_infer_response(
            model_name="m",
            model_version=None,
            request_id=None,
            outputs=[("y", torch.ones(1))],
            request=request,
        )


def test_output_dtype_without_protocol_type_is_a_server_error():
    with pytest.raises(NeuronServeError, match="complex64") as info:
        encode_infer_response(
            model_name="m",
            model_version=None,
            request_id=None,
            outputs=[("y", torch.ones(1, dtype=torch.complex64))],
            request=None,
        )
    assert not isinstance(info.value, InvalidInput)


# --- request details ----------------------------------------------------------------------


def test_nested_data_is_row_major():
    body = one_input(shape=[2, 3], datatype="INT32", data=[[1, 2, 3], [4, 5, 6]])
    tensor = parse_infer_request(body, {}).inputs[0].tensor
    assert_same(tensor, torch.arange(1, 7, dtype=torch.int32).reshape(2, 3))


def test_nan_and_infinity_are_floats_only():
    body = (
        b'{"inputs":[{"name":"x","shape":[3],"datatype":"FP32","data":[NaN,Infinity,-Infinity]}]}'
    )
    tensor = parse_infer_request(body, {}).inputs[0].tensor
    assert tensor.isnan()[0] and tensor[1] == float("inf") and tensor[2] == float("-inf")
    with pytest.raises(InvalidInput, match="INT32 data must be integers; element 0 is nan"):
        parse_infer_request(body.replace(b"FP32", b"INT32"), {})


def test_bool_from_json_and_integers_for_floats():
    body = one_input(shape=[2], datatype="BOOL", data=[True, False])
    assert_same(parse_infer_request(body, {}).inputs[0].tensor, torch.tensor([True, False]))
    body = one_input(data=[1, 2, 3])
    assert_same(parse_infer_request(body, {}).inputs[0].tensor, torch.tensor([1.0, 2.0, 3.0]))


def test_header_name_is_case_insensitive():
    original = sample("FP64")
    body, headers = triton_body([triton_input("x", original, True)])
    request = parse_infer_request(body, {HLEN.lower(): headers[HLEN]})
    assert_same(request.inputs[0].tensor, original)


def test_binary_tensor_owns_its_memory():
    body, headers = triton_body([triton_input("x", sample("INT16"), True)])
    tensor = parse_infer_request(bytearray(body), headers).inputs[0].tensor
    tensor += 1  # writable, and not a view of the request body


def test_shape_over_max_elements_is_refused_before_allocation(monkeypatch):
    def no_tensor(*args, **kwargs):
        raise AssertionError("a tensor was built for a refused input")

    monkeypatch.setattr(oip_rest, "tensor_from_bytes", no_tensor)
    monkeypatch.setattr(oip_rest, "tensor_from_json", no_tensor)
    doc = {
        "inputs": [
            {
                "name": "x",
                "shape": [1 << 40],
                "datatype": "FP64",
                "parameters": {"binary_data_size": 8 << 40},
            }
        ]
    }
    tracemalloc.start()
    try:
        with pytest.raises(InvalidInput, match=r"input 'x': shape \[1099511627776\] has more than"):
            parse_infer_request(*with_binary(doc, b"\0" * 64))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20
    with pytest.raises(InvalidInput, match="more than max_elements=2 elements"):
        parse_infer_request(one_input(), {}, max_elements=2)
    with pytest.raises(InvalidInput, match="more than max_elements"):
        parse_infer_request(one_input(shape=[0, 1 << 40, 1 << 40], data=[]), {})


# --- malformed requests ----------------------------------------------------------------

_X = {"name": "x", "shape": [3], "datatype": "FP32", "data": [1.0, 2.0, 3.0]}
_XB = {"name": "x", "shape": [3], "datatype": "FP32", "parameters": {"binary_data_size": 12}}


def _inputs(*entries, **top):
    return json_body({"inputs": list(entries), **top}), {}


# fmt: off
_BIN_8 = {"inputs": [{**_XB, "parameters": {"binary_data_size": 8}}]}
_BIN_STR = {"inputs": [{**_XB, "parameters": {"binary_data_size": "12"}}]}
_BOOL3 = {"inputs": [{**_XB, "datatype": "BOOL", "parameters": {"binary_data_size": 3}}]}
_Y = {"name": "y"}

MALFORMED = [  # (id, body, headers, message fragment)
    ("not utf-8", b'{"inputs": "\xff"}', {}, "not valid UTF-8"),
    ("not json", b'{"inputs": [', {}, "not valid JSON"),
    ("empty body", b"", {}, "not valid JSON"),
    ("too deep", b"[" * 100000, {}, "nested too deeply"),
    ("top level list", b"[]", {}, "must be a JSON object, got a list"),
    ("no inputs", b"{}", {}, "inputs is required"),
    ("inputs not list", b'{"inputs": {}}', {}, "inputs must be a list, got an object"),
    ("input not object", b'{"inputs": [3]}', {}, "inputs[0] must be an object"),
    ("no name", one_input(name=...), {}, "inputs[0].name is required"),
    ("duplicate name", *_inputs(_X, _X), "duplicate input name 'x'"),
    ("shape not list", one_input(shape="3"), {}, 'inputs[0].shape must be a list, got a string ("3")'),
    ("negative dim", one_input(shape=[-1]), {}, "dimension 0 is -1 (a number); dimensions must"),
    ("float dim", one_input(shape=[3.0]), {}, "inputs[0].shape[0] must be an integer, got a number (3.0)"),
    ("bool dim", one_input(shape=[True]), {}, "inputs[0].shape[0] must be an integer, got a boolean (true)"),
    ("rank", one_input(shape=[1] * 65), {}, "shape has 65 dimensions, more than 64"),
    ("too many elements", one_input(shape=[1 << 30]), {}, "has more than max_elements=67108864"),
    ("unknown datatype", one_input(datatype="FP8"), {}, "'x': unknown datatype 'FP8'; use one of"),
    ("no datatype", one_input(datatype=...), {}, "inputs[0].datatype is required"),
    ("bytes", one_input(datatype="BYTES"), {}, "datatype BYTES is not supported"),
    ("length", one_input(data=[1.0, 2.0]), {}, "shape [3] needs 3 elements in 'data', got 2"),
    ("nested length", one_input(data=[[1.0], [2.0, 3.0, 4.0]]), {}, "3 elements in 'data', got 4"),
    ("data not list", one_input(data=5), {}, "inputs[0].data must be a list, got a number (5)"),
    ("data null", one_input(data=None), {}, "input 'x' has no data: give 'data'"),
    ("string in FP32", one_input(data=[1.0, "a", 3.0]), {},
     "FP32 data must be numbers; element 1 is 'a'"),
    ("null in FP64", one_input(datatype="FP64", data=[1.0, None, 3.0]), {},
     "element 1 is None (null)"),
    ("bool in FP16", one_input(datatype="FP16", data=[1.0, True, 3.0]), {},
     "FP16 data must be numbers"),
    ("huge int in FP32", one_input(data=[1, 10**400, 3]), {}, "element 1 = 1000000000000000000"),
    ("float in INT64", one_input(datatype="INT64", data=[1, 2.5, 3]), {},
     "INT64 data must be integers; element 1 is 2.5"),
    ("bool in INT8", one_input(datatype="INT8", data=[1, 2, False]), {}, "element 2 is False"),
    ("UINT8 range", one_input(datatype="UINT8", data=[0, 256, 1]), {},
     "element 1 = 256 (a number) is out of range for UINT8 [0, 255]"),
    ("INT64 range", one_input(datatype="INT64", data=[0, 0, 2**63]), {}, "out of range for INT64"),
    ("int in BOOL", one_input(datatype="BOOL", data=[True, 1, False]), {},
     "BOOL data must be true or false; element 1 is 1"),
    ("both", one_input(parameters={"binary_data_size": 12}), {},
     "has both 'data' and parameters.binary_data_size"),
    ("neither", one_input(data=...), {},
     "input 'x' has no data: give 'data' or parameters.binary_data_size"),
    ("binary size wrong", *with_binary(_BIN_8, b"\0" * 8),
     "binary_data_size is 8 but shape [3] of FP32 needs 12 bytes"),
    ("binary size not int", *with_binary(_BIN_STR, b"\0" * 12), 'inputs[0].parameters.binary_data_size must be an integer, got a string ("12")'),
    ("header over body", *with_binary({"inputs": [_XB]}, b"\0" * 12, header_length=10**6),
     "request body is only"),
    ("header huge", *with_binary({"inputs": [_XB]}, b"", header_length=10**40),
     "request body is only"),
    ("header not int", json_body({"inputs": [_X]}), {HLEN: "twelve"},
     "must be an integer, got 'twelve'"),
    ("header float", json_body({"inputs": [_X]}), {HLEN: "1.5"}, "must be an integer"),
    ("header negative", json_body({"inputs": [_X]}), {HLEN: "-3"}, "must not be negative"),
    ("conflicting headers", json_body({"inputs": [_X]}), {HLEN: "3", HLEN.lower(): "4"},
     "conflicting"),
    ("binary longer", *with_binary({"inputs": [_XB]}, b"\0" * 13),
     "is 13 bytes, longer than the 12 bytes"),
    ("binary shorter", *with_binary({"inputs": [_XB]}, b"\0" * 11),
     "is 11 bytes, shorter than the 12 bytes"),
    ("binary without inputs", *with_binary({"inputs": [_X]}, b"\0"),
     "is 1 bytes, longer than the 0 bytes"),
    ("binary size without header", *_inputs(_XB),
     "has no Inference-Header-Content-Length header"),
    ("BOOL byte 2", *with_binary(_BOOL3, b"\x01\x00\x02"),
     "BOOL binary data must be bytes 0 or 1; byte 2 is 2"),
    ("shared memory", one_input(data=..., parameters={"shared_memory_region": "r"}), {},
     "shared memory"),
    ("input parameters", one_input(parameters=[1]), {}, "inputs[0].parameters must be an object, got a list"),
    ("id not string", *_inputs(_X, id=7), "id must be a string, got a number (7)"),
    ("parameters not object", *_inputs(_X, parameters="p"),
     'parameters must be an object, got a string ("p")'),
    ("binary_data_output", *_inputs(_X, parameters={"binary_data_output": 1}),
     "parameters.binary_data_output must be true or false, got a number (1)"),
    ("outputs not list", *_inputs(_X, outputs=_Y), "outputs must be a list, got an object"),
    ("output not object", *_inputs(_X, outputs=["y"]), "outputs[0] must be an object"),
    ("output no name", *_inputs(_X, outputs=[{}]), "outputs[0].name is required"),
    ("output binary_data", *_inputs(_X, outputs=[{**_Y, "parameters": {"binary_data": "yes"}}]),
     'outputs[0].parameters.binary_data must be true or false, got a string ("yes")'),
    ("output duplicate", *_inputs(_X, outputs=[_Y, _Y]), "duplicate requested output 'y'"),
    ("classification", *_inputs(_X, outputs=[{**_Y, "parameters": {"classification": 3}}]),
     "parameter 'classification' is not supported"),
    # The JSON type of every field (the codec once answered 500 to these two).
    ("datatype list", one_input(datatype=["FP32"]), {}, "inputs[0].datatype must be a string, got a list"),
    ("datatype object", one_input(datatype={"t": 1}), {},
     "inputs[0].datatype must be a string, got an object"),
    ("name number", one_input(name=3), {}, "inputs[0].name must be a string, got a number (3)"),
    ("name empty", one_input(name=""), {}, "inputs[0].name must not be empty"),
    ("name huge", one_input(name="n" * 300), {}, "inputs[0].name has 300 characters, more than 256"),
    ("id huge", *_inputs(_X, id="i" * 2000), "id has 2000 characters, more than 1024"),
    ("shape null", one_input(shape=None), {}, "inputs[0].shape must be a list, got null"),
    ("shape nested", one_input(shape=[[3]]), {}, "inputs[0].shape[0] must be an integer, got a list"),
    ("binary size negative", *with_binary({"inputs": [{**_XB, "parameters": {"binary_data_size": -1}}]}, b""),
     "inputs[0].parameters.binary_data_size must be >= 0, got -1"),
    ("binary size bool", *with_binary({"inputs": [{**_XB, "parameters": {"binary_data_size": True}}]}, b""),
     "inputs[0].parameters.binary_data_size must be an integer, got a boolean (true)"),
    ("second input", *_inputs(_X, {**_X, "name": "z", "datatype": 1}),
     "inputs[1].datatype must be a string, got a number (1)"),
    ("unknown input key", one_input(dtype="FP32"), {},
     "inputs[0].dtype is not a field of an OIP v2 infer request; remove it"),
    ("unknown top key", *_inputs(_X, model="m"), "model is not a field of an OIP v2 infer request"),
    ("output name huge", *_inputs(_X, outputs=[{"name": "o" * 257}]), "outputs[0].name has 257 characters"),
    ("duplicate key", b'{"inputs": [{"name": "x", "name": "y", "shape": [0], "datatype": "FP32", "data": []}]}',
     {}, "request JSON has the key 'name' twice in one object; give it once"),
    ("duplicate top key", b'{"inputs": [], "inputs": []}', {}, "the key 'inputs' twice"),
    ("duplicate escaped key", b'{"parameters": {"a\\"b": 1, "a\\"b": 2}, "inputs": []}', {},
     "request JSON has the key 'a\"b' twice in one object"),
    ("lone surrogate", b'{"id": "\\ud800", "inputs": []}', {}, "not valid JSON"),
    ("duplicate key in binary header",
     b'{"id": "a", "id": "b", "inputs": []}\0\0', {HLEN: "36"}, "the key 'id' twice"),
]
# fmt: on


@pytest.mark.parametrize(
    ("body", "headers", "fragment"), [c[1:] for c in MALFORMED], ids=[c[0] for c in MALFORMED]
)
def test_malformed_request_is_invalid_input(body, headers, fragment):
    with pytest.raises(InvalidInput) as info:
        parse_infer_request(body, headers)
    assert fragment in str(info.value)
    assert info.value.http_status == 400


def test_malformed_table_is_large():
    assert len(MALFORMED) >= 25


# --- property: bad bytes only ever give InvalidInput ---------------------------------------

_json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=4),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner, max_size=4)
    ),
    max_leaves=12,
)
_dims = st.lists(st.integers(-1, 4) | st.sampled_from([1 << 40, 2.0, True, "2"]), max_size=3)
_datatype = st.sampled_from([*DATATYPES, "BYTES", "FP8", None])
_elements = st.lists(
    st.integers(-300, 300)
    | st.floats()
    | st.booleans()
    | st.just("a")
    | st.lists(st.integers(0, 1), max_size=2),
    max_size=12,
)
_input = st.fixed_dictionaries(
    {"name": st.sampled_from(["x", "y", ""]), "datatype": _datatype, "shape": _dims | _json_values},
    optional={
        "data": _elements | _json_values,
        "parameters": st.fixed_dictionaries({}, optional={"binary_data_size": st.integers(-1, 40)})
        | _json_values,
    },
)
_request = st.fixed_dictionaries(
    {"inputs": st.lists(_input, max_size=3) | _json_values},
    optional={
        "id": st.text(max_size=3) | _json_values,
        "outputs": st.lists(
            st.fixed_dictionaries(
                {"name": st.sampled_from(["y", "z"])}, optional={"parameters": _json_values}
            ),
            max_size=2,
        )
        | _json_values,
        "parameters": _json_values,
    },
)
_header = st.none() | st.integers(-5, 600).map(str) | st.text(max_size=6)


def _check_parsed(body: bytes, headers: dict) -> None:
    try:
        request = parse_infer_request(body, headers, max_elements=1 << 12)
    except InvalidInput:
        return
    for inp in request.inputs:
        assert inp.tensor.dtype == DATATYPE_TO_TORCH[inp.datatype]
        assert tuple(inp.tensor.shape) == inp.shape


_SETTINGS = settings(
    max_examples=300, derandomize=True, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


@_SETTINGS
@given(body=st.binary(max_size=200), header=_header)
def test_random_bytes_only_raise_invalid_input(body, header):
    _check_parsed(body, {} if header is None else {HLEN: header})


@_SETTINGS
@given(doc=_request, tail=st.binary(max_size=40), header=_header, use_length=st.booleans())
def test_random_requests_only_raise_invalid_input(doc, tail, header, use_length):
    text = json.dumps(doc).encode()
    if use_length:
        header = str(len(text))
    _check_parsed(
        text + tail if header is not None else text, {} if header is None else {HLEN: header}
    )


_ELEMENT = {
    "BOOL": st.booleans(),
    "UINT8": st.integers(-2, 257),
    "INT8": st.integers(-130, 130),
    "FP16": st.floats(width=16) | st.integers(-70000, 70000),
    "BF16": st.floats(width=32),
}
_ELEMENT.update({t: st.integers(-(2**64), 2**64) for t in ("INT16", "INT32", "INT64")})
_ELEMENT.update({t: st.floats() | st.integers() for t in ("FP32", "FP64")})


@st.composite
def _plausible_request(draw):
    """A request that is valid or close to it, so the deep checks are reached too."""
    doc = {"inputs": []}
    tail = b""
    for name in draw(st.lists(st.sampled_from("abc"), max_size=3, unique=True)):
        datatype = draw(st.sampled_from(DATATYPES))
        shape = draw(st.lists(st.integers(0, 3), max_size=3))
        count = draw(st.sampled_from([prod(shape)] * 4 + [prod(shape) + 1, 0]))
        entry = {"name": name, "datatype": datatype, "shape": shape}
        if draw(st.booleans()):
            element = _ELEMENT[datatype] | st.sampled_from([None, "1", 1.5, True, float("nan")])
            entry["data"] = draw(st.lists(element, min_size=count, max_size=count))
        else:
            size = count * datatype_itemsize(datatype)
            entry["parameters"] = {"binary_data_size": size}
            tail += draw(st.binary(min_size=size, max_size=size))
        doc["inputs"].append(entry)
    doc["outputs"] = draw(
        st.lists(st.fixed_dictionaries({"name": st.sampled_from("yz")}), max_size=2, unique_by=str)
    )
    text = json.dumps(doc).encode()
    tail += draw(st.sampled_from([b""] * 4 + [b"\0"]))
    length = draw(st.sampled_from([len(text)] * 4 + [len(text) - 1, len(text) + 1, None]))
    return text + tail, {} if length is None else {HLEN: str(length)}


@_SETTINGS
@given(request=_plausible_request())
def test_plausible_requests_only_raise_invalid_input(request):
    _check_parsed(*request)


# --- check_inputs ----------------------------------------------------------------------------

SPECS = [TensorSpec("ids", "INT64", (-1, 8)), TensorSpec("mask", "BOOL", (-1, -1))]


def _inp(name, tensor):
    return InferInput(name, TORCH_TO_DATATYPE[tensor.dtype], tuple(tensor.shape), tensor)


def test_check_inputs_returns_expected_order():
    ids, mask = torch.zeros(2, 8, dtype=torch.int64), torch.ones(2, 8, dtype=torch.bool)
    out = check_inputs([_inp("mask", mask), _inp("ids", ids)], SPECS)
    assert out[0] is ids and out[1] is mask


@pytest.mark.parametrize(
    ("given_inputs", "fragment"),
    [
        (
            [
                ("ids", torch.zeros(2, 8, dtype=torch.int64)),
                ("mask", torch.ones(2, 8, dtype=torch.bool)),
                ("extra", torch.ones(1)),
            ],
            "unknown input 'extra'; the model expects: ids, mask",
        ),
        (
            [("ids", torch.zeros(2, 8, dtype=torch.int64))],
            "missing input 'mask'; the model expects: ids, mask",
        ),
        (
            [
                ("ids", torch.zeros(2, 8, dtype=torch.int32)),
                ("mask", torch.ones(2, 8, dtype=torch.bool)),
            ],
            "input 'ids' has datatype INT32; expected INT64",
        ),
        (
            [
                ("ids", torch.zeros(2, 8, 1, dtype=torch.int64)),
                ("mask", torch.ones(2, 8, dtype=torch.bool)),
            ],
            "input 'ids' has shape [2, 8, 1]; expected [-1, 8]",
        ),
        (
            [
                ("ids", torch.zeros(2, 7, dtype=torch.int64)),
                ("mask", torch.ones(2, 8, dtype=torch.bool)),
            ],
            "input 'ids' has shape [2, 7]; expected [-1, 8]",
        ),
        (
            [
                ("ids", torch.zeros(2, 8, dtype=torch.int64)),
                ("ids", torch.zeros(2, 8, dtype=torch.int64)),
            ],
            "duplicate input name 'ids'",
        ),
    ],
    ids=["unknown", "missing", "datatype", "rank", "fixed dim", "duplicate"],
)
def test_check_inputs_refuses(given_inputs, fragment):
    with pytest.raises(InvalidInput) as info:
        check_inputs([_inp(name, t) for name, t in given_inputs], SPECS)
    assert str(info.value) == fragment


def test_check_inputs_after_parse():
    body, headers = triton_body(
        [
            triton_input("ids", torch.arange(16).reshape(2, 8), True),
            triton_input("mask", torch.ones(2, 8, dtype=torch.bool), False),
        ]
    )
    ids, mask = check_inputs(parse_infer_request(body, headers).inputs, SPECS)
    assert_same(ids, torch.arange(16).reshape(2, 8))
    assert bool(mask.all())


@pytest.mark.parametrize(
    ("datatype", "shape"), [("BYTES", (1,)), ("FP32", (-2,)), ("FP32", (1.5,))]
)
def test_tensor_spec_refuses_bad_declarations(datatype, shape):
    with pytest.raises(ConfigError):
        TensorSpec("x", datatype, shape)


@pytest.mark.parametrize(
    "extra",
    [{"id": None}, {"parameters": None}, {"outputs": None}, {"parameters": {"binary_data_output": None}},
     {"parameters": {"custom": [1, {"a": None}]}}],
    ids=["id", "parameters", "outputs", "binary_data_output", "open parameters"],
)
def test_null_optional_fields_mean_absent(extra):
    request = parse_infer_request(json_body({"inputs": [_X], **extra}), {})
    assert request.inputs[0].tensor.tolist() == [1.0, 2.0, 3.0]
    assert request.binary_output is False


def test_null_data_with_binary_size_means_binary():
    body, headers = with_binary({"inputs": [{**_XB, "data": None}]}, np.array([1, 2, 3], dtype="<f4").tobytes())
    assert parse_infer_request(body, headers).inputs[0].tensor.tolist() == [1.0, 2.0, 3.0]


def test_model_name_in_the_body_as_kserve_sends_it():
    doc = {"model_name": "m", "model_version": "1", "inputs": [{"name": "x", "shape": [1], "datatype": "FP32", "data": [1.0]}]}
    request = parse_infer_request(json_body(doc), {}, model="m")
    assert request.inputs[0].name == "x"
    with pytest.raises(InvalidInput) as info:
        parse_infer_request(json_body({**doc, "model_name": "other"}), {}, model="m")
    assert str(info.value) == ("model_name is 'other' but this is model 'm'; send it to "
                               "/v2/models/other/infer or drop model_name")
    with pytest.raises(InvalidInput, match=r"^model_name must be a string, got a number \(3\)"):
        parse_infer_request(json_body({**doc, "model_name": 3}), {}, model="m")
