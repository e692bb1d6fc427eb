"""OIP v2 gRPC codec: ``ModelInferRequest`` in, ``ModelInferResponse`` out.

A request decodes straight into the data plane's `InferRequest`: ``raw_input_contents``
become tensors over the message's bytes (``np.frombuffer``, no copy), typed ``contents``
one array each; no JSON is written or read on the way. The checks are those of the REST
codec (names, datatypes, shapes and the element limit, through the same helpers and
with the same messages); where a mistake can only be made in gRPC (a contents field of
the wrong type, raw and typed data together) the message names the gRPC field. Outputs
go back in ``raw_output_contents``, as Triton answers. Messages come from tritonclient's
generated ``inference`` package (a superset of KServe's).
"""

from __future__ import annotations

import warnings
from math import prod
from typing import Any

import numpy as np
import torch
from tritonclient.grpc import service_pb2 as pb

from ...errors import InvalidInput
from .infer import (
    InferInput,
    InferRequest,
    InferResponse,
    RequestedOutput,
    datatype_itemsize,
    format_shape,
)
from .oip_rest import DEFAULT_MAX_ELEMENTS, check_datatype, check_shape
from .oip_rest_schema import MAX_ID_CHARS, MAX_NAME_CHARS
from .oip_tensors import describe

# The typed-contents field and numpy dtype of each datatype; FP16 and BF16 have no
# typed field in the protocol and travel only in raw_input_contents.
_CONTENTS = {
    "BOOL": ("bool_contents", np.bool_), "INT8": ("int_contents", np.int8), "INT16": ("int_contents", np.int16),
    "INT32": ("int_contents", np.int32), "INT64": ("int64_contents", np.int64), "UINT8": ("uint_contents", np.uint8),
    "UINT16": ("uint_contents", np.uint16), "UINT32": ("uint_contents", np.uint32),
    "UINT64": ("uint64_contents", np.uint64), "FP32": ("fp32_contents", np.float32),
    "FP64": ("fp64_contents", np.float64),
}
_ALL_FIELDS = ("bool_contents", "int_contents", "int64_contents", "uint_contents", "uint64_contents",
               "fp32_contents", "fp64_contents", "bytes_contents")
# numpy's view of each datatype's raw bytes (little-endian); BF16 travels as its bits.
_RAW = {"BOOL": "u1", "UINT8": "u1", "INT8": "i1", "INT16": "<i2", "INT32": "<i4", "INT64": "<i8",
        "FP16": "<f2", "FP32": "<f4", "FP64": "<f8", "BF16": "<i2"}


def decode_request(request: pb.ModelInferRequest, *, max_elements: int = DEFAULT_MAX_ELEMENTS) -> InferRequest:
    """Decode a gRPC infer request; raises `InvalidInput` for every malformed one."""
    raw = request.raw_input_contents
    if raw and len(raw) != len(request.inputs):
        raise InvalidInput(f"raw_input_contents has {len(raw)} entries for {len(request.inputs)} inputs; "
                           "give one per input, in the order of 'inputs'")
    if len(request.id) > MAX_ID_CHARS:
        raise InvalidInput(f"id has {len(request.id)} characters, more than {MAX_ID_CHARS}")
    inputs: list[InferInput] = []
    seen: set[str] = set()
    for index, tensor in enumerate(request.inputs):
        _check_name(tensor.name, f"inputs[{index}].name")
        if tensor.name in seen:
            raise InvalidInput(f"duplicate input name '{tensor.name}'")
        seen.add(tensor.name)
        inputs.append(_decode_input(tensor, raw[index] if raw else None, max_elements))
    return InferRequest(id=request.id or None, inputs=inputs, outputs=_requested_outputs(request),
                        binary_output=True, parameters=_parameters(request.parameters))


def encode_response(response: InferResponse) -> pb.ModelInferResponse:
    """The gRPC answer of the data plane's response: every output in raw_output_contents."""
    message = pb.ModelInferResponse(model_name=response.model_name, model_version=response.model_version or "",
                                    id=response.id or "")
    for output in response.outputs:
        tensor = output.tensor.detach().cpu()
        message.outputs.add(name=output.name, datatype=output.datatype, shape=list(tensor.shape))
        if tensor.dtype is torch.bfloat16:  # numpy has no bfloat16: its bits travel as int16
            tensor = tensor.view(torch.int16)
        message.raw_output_contents.append(np.ascontiguousarray(tensor.numpy()).tobytes())
    return message


def _check_name(name: str, field: str) -> None:
    if not name:
        raise InvalidInput(f"{field} must not be empty")
    if len(name) > MAX_NAME_CHARS:
        raise InvalidInput(f"{field} has {len(name)} characters, more than {MAX_NAME_CHARS}")


def _decode_input(tensor: pb.ModelInferRequest.InferInputTensor, chunk: bytes | None,
                  max_elements: int) -> InferInput:
    label = f"input '{tensor.name}'"
    check_datatype(tensor.datatype, label)
    shape = check_shape(list(tensor.shape), label, max_elements)
    if "shared_memory_region" in tensor.parameters:
        raise InvalidInput(f"{label}: shared memory inputs are not supported; send the data")
    if chunk is not None and tensor.HasField("contents"):
        # Both would leave one of them unread; say which the client meant.
        raise InvalidInput(f"{label}: data is in both contents and raw_input_contents; give it in one of them")
    if chunk is None:
        array = _typed_array(tensor, shape, label)
    else:
        array = _raw_array(tensor.datatype, shape, chunk, label)
    return InferInput(tensor.name, tensor.datatype, shape, _as_tensor(array, tensor.datatype, shape))


def _raw_array(datatype: str, shape: tuple[int, ...], chunk: bytes, label: str) -> np.ndarray:
    needed = prod(shape) * datatype_itemsize(datatype)
    if len(chunk) != needed:
        raise InvalidInput(f"{label}: raw_input_contents holds {len(chunk)} bytes but shape "
                           f"{format_shape(shape)} of {datatype} needs {needed} bytes")
    array = np.frombuffer(chunk, dtype=_RAW[datatype])  # a view of the message's bytes
    if datatype == "BOOL" and len(array):
        bad = np.flatnonzero(array > 1)
        if len(bad):
            # Any other byte would be an invalid bool; refuse rather than guess.
            raise InvalidInput(f"{label}: BOOL binary data must be bytes 0 or 1; "
                               f"byte {int(bad[0])} is {int(array[bad[0]])}")
    return array


def _typed_array(tensor: pb.ModelInferRequest.InferInputTensor, shape: tuple[int, ...], label: str) -> np.ndarray:
    entry = _CONTENTS.get(tensor.datatype)
    if entry is None:
        raise InvalidInput(f"{label}: {tensor.datatype} has no typed contents field; send it in raw_input_contents")
    field, dtype = entry
    values = getattr(tensor.contents, field)
    needed = prod(shape)
    if len(values) != needed:
        others = [f for f in _ALL_FIELDS if f != field and len(getattr(tensor.contents, f))]
        if not len(values) and others:
            raise InvalidInput(f"{label}: {tensor.datatype} data goes in contents.{field}, "
                               f"not contents.{others[0]}")
        raise InvalidInput(f"{label}: contents.{field} has {len(values)} values but shape "
                           f"{format_shape(shape)} needs {needed}")
    if field in ("int_contents", "uint_contents"):
        # These fields are 32 bits wide for every narrower type too: a value past the
        # datatype's range would wrap silently in the cast, so it is refused.
        wide = np.asarray(values)
        info = np.iinfo(dtype)
        bad = np.flatnonzero((wide < info.min) | (wide > info.max))
        if len(bad):
            index = int(bad[0])
            raise InvalidInput(f"{label}: element {index} = {describe(int(wide[index]))} is out of range for "
                               f"{tensor.datatype} [{info.min}, {info.max}]")
    return np.asarray(values, dtype=dtype)


_warned = False


def _as_tensor(array: np.ndarray, datatype: str, shape: tuple[int, ...]) -> torch.Tensor:
    global _warned
    if _warned:
        tensor = torch.from_numpy(array)
    else:
        with warnings.catch_warnings():
            # A view of the message's read-only bytes: torch warns, once per process,
            # that it could write there; nothing does (the runtime copies rows when it
            # batches them). catch_warnings costs microseconds: only the first time.
            warnings.simplefilter("ignore", UserWarning)
            tensor = torch.from_numpy(array)
        _warned = not array.flags.writeable
    if datatype == "BF16":
        tensor = tensor.view(torch.bfloat16)
    elif datatype == "BOOL":
        tensor = tensor.view(torch.bool)
    return tensor.reshape(shape)


def _requested_outputs(request: pb.ModelInferRequest) -> list[RequestedOutput] | None:
    outputs: list[RequestedOutput] = []
    seen: set[str] = set()
    for index, output in enumerate(request.outputs):
        _check_name(output.name, f"outputs[{index}].name")
        if output.name in seen:
            raise InvalidInput(f"duplicate requested output '{output.name}'")
        seen.add(output.name)
        for unsupported in ("shared_memory_region", "classification"):
            if unsupported in output.parameters:
                raise InvalidInput(f"requested output '{output.name}': parameter '{unsupported}' is not supported")
        outputs.append(RequestedOutput(output.name, True, _parameters(output.parameters)))
    return outputs or None


def _parameters(parameters: Any) -> dict[str, Any]:
    """An ``InferParameter`` map as plain values."""
    return {key: getattr(value, value.WhichOneof("parameter_choice") or "bool_param")
            for key, value in parameters.items()}
