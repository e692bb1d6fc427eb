"""OIP v2 gRPC messages to and from the REST codec's binary form.

A ``ModelInferRequest`` becomes the REST body of the binary tensor data extension (a
JSON header and each input's raw bytes), so gRPC requests go through the very parser,
checks, limits and batcher that HTTP requests do, and fail with the same messages. The
REST answer, asked for in binary, becomes a ``ModelInferResponse`` with
``raw_output_contents``, as Triton answers. Messages come from tritonclient's generated
``inference`` package (a superset of KServe's).
"""

from __future__ import annotations

import json
from collections.abc import Mapping

import numpy as np
from tritonclient.grpc import service_pb2 as pb

from ..errors import InvalidInput
from .oip import HEADER_LENGTH

# The typed-contents field and numpy dtype of each datatype; FP16 and BF16 have no
# typed field in the protocol and travel only in raw_input_contents.
_CONTENTS = {
    "BOOL": ("bool_contents", np.bool_), "INT8": ("int_contents", np.int8), "INT16": ("int_contents", np.int16),
    "INT32": ("int_contents", np.int32), "INT64": ("int64_contents", np.int64), "UINT8": ("uint_contents", np.uint8),
    "UINT16": ("uint_contents", np.uint16), "UINT32": ("uint_contents", np.uint32),
    "UINT64": ("uint64_contents", np.uint64), "FP32": ("fp32_contents", np.float32),
    "FP64": ("fp64_contents", np.float64),
}


def _typed_bytes(tensor: pb.ModelInferRequest.InferInputTensor) -> bytes:
    entry = _CONTENTS.get(tensor.datatype)
    if entry is None:
        if tensor.datatype in ("FP16", "BF16"):
            raise InvalidInput(f"input '{tensor.name}': {tensor.datatype} has no typed contents field; "
                               "send it in raw_input_contents")
        return b""  # the REST parser refuses the datatype with its own message
    field, dtype = entry
    values = getattr(tensor.contents, field)
    try:
        array = np.asarray(values, dtype=dtype)
    except (OverflowError, ValueError) as exc:
        raise InvalidInput(f"input '{tensor.name}': contents.{field} do not fit {tensor.datatype}: {exc}") from None
    return array.astype(array.dtype.newbyteorder("<"), copy=False).tobytes()


def request_to_rest(request: pb.ModelInferRequest) -> tuple[bytes, dict[str, str]]:
    """The REST body and headers (binary tensor data extension) of a gRPC infer request."""
    raw = request.raw_input_contents
    if raw and len(raw) != len(request.inputs):
        raise InvalidInput(f"raw_input_contents has {len(raw)} entries for {len(request.inputs)} inputs; "
                           "give one per input, in the order of 'inputs'")
    entries, chunks = [], []
    for index, tensor in enumerate(request.inputs):
        if raw and tensor.HasField("contents"):
            # Both would leave one of them unread; say which the client meant.
            raise InvalidInput(f"input '{tensor.name}': data is in both contents and raw_input_contents; "
                               "give it in one of them")
        chunk = raw[index] if raw else _typed_bytes(tensor)
        entries.append({"name": tensor.name, "datatype": tensor.datatype, "shape": list(tensor.shape),
                        "parameters": {"binary_data_size": len(chunk)}})
        chunks.append(chunk)
    doc: dict = {"inputs": entries, "parameters": {"binary_data_output": True}}
    if request.id:
        doc["id"] = request.id
    if request.outputs:
        doc["outputs"] = [{"name": o.name, "parameters": {"binary_data": True}} for o in request.outputs]
    header = json.dumps(doc, separators=(",", ":")).encode()
    return header + b"".join(chunks), {HEADER_LENGTH: str(len(header))}


def response_from_rest(body: bytes, headers: Mapping[str, str]) -> pb.ModelInferResponse:
    """The gRPC infer response of a REST answer encoded with binary outputs."""
    length = int(headers.get(HEADER_LENGTH, len(body)))
    doc = json.loads(body[:length])
    response = pb.ModelInferResponse(model_name=doc["model_name"], model_version=doc.get("model_version", ""),
                                     id=doc.get("id", ""))
    offset = length
    for out in doc["outputs"]:
        response.outputs.add(name=out["name"], datatype=out["datatype"], shape=out["shape"])
        size = out["parameters"]["binary_data_size"]
        response.raw_output_contents.append(body[offset:offset + size])
        offset += size
    return response
