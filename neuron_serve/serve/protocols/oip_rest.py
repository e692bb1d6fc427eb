"""Open Inference Protocol v2 REST codec: infer requests in, infer responses out.

Implements the KServe v2 / Triton HTTP JSON infer request and response, and Triton's
binary tensor data extension: with an `Inference-Header-Content-Length: N` header, the
first N bytes of the body are the JSON header and the rest is the raw little-endian,
row-major bytes of every tensor that declares `parameters.binary_data_size`, in order.

Pure functions over bytes and headers; the HTTP layer only moves bytes. Every flaw in
a request raises `InvalidInput` (HTTP 400) naming the input and the problem, and no
tensor is allocated before its size has been checked against the body and the limit.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from math import prod
from typing import Any

import torch

from neuron_serve.errors import InvalidInput
from neuron_serve.serve.protocols.infer import (
    DATATYPE_TO_TORCH,
    TORCH_TO_DATATYPE,
    UNSUPPORTED_DATATYPES,
    InferInput,
    InferRequest,
    InferResponse,
    RequestedOutput,
    TensorSpec,
    check_inputs,
    datatype_itemsize,
    format_shape,
    select_outputs,
)
from neuron_serve.serve.protocols.oip_rest_schema import DEEPEST, check_request, load_json
from neuron_serve.serve.protocols.oip_tensors import describe, tensor_from_bytes, tensor_from_json

__all__ = [
    "DATATYPE_TO_TORCH",
    "HEADER_LENGTH",
    "TORCH_TO_DATATYPE",
    "InferInput",
    "InferRequest",
    "RequestedOutput",
    "TensorSpec",
    "check_inputs",
    "encode_infer_response",
    "encode_response",
    "parse_infer_request",
]

HEADER_LENGTH = "Inference-Header-Content-Length"
DEFAULT_MAX_ELEMENTS = 1 << 26
# torch accepts far more dims, but no model does; a bound keeps a hostile shape of a
# million 1s from costing time in torch's size bookkeeping.
MAX_RANK = 64

_SUPPORTED = ", ".join(DATATYPE_TO_TORCH)


@dataclass
class _InputPlan:
    """An input whose header has been validated but whose tensor is not built yet."""

    name: str
    datatype: str
    shape: tuple[int, ...]
    data: list[Any] | None
    binary_size: int | None


def parse_infer_request(
    body: bytes, headers: Mapping[str, str], *, max_elements: int = DEFAULT_MAX_ELEMENTS, model: str | None = None
) -> InferRequest:
    """Decode an OIP v2 REST infer request body (JSON, or JSON + binary tensor data).

    `headers` is looked up case-insensitively for `Inference-Header-Content-Length`.
    Each input holds at most `max_elements` elements; larger shapes are refused before
    any allocation. A `model_name` in the body (KServe's client sends one) must be
    `model`, the model the URL names. Raises `InvalidInput` for every malformed request.
    """
    body = bytes(body)
    header_length = _header_length(headers, len(body))
    doc = _load_json(body if header_length is None else body[:header_length], header_length)
    binary = memoryview(body)[len(body) if header_length is None else header_length :]
    # Every field's JSON type first, so the checks below only see the types they expect.
    check_request(doc)
    if model is not None and doc.get("model_name") not in (None, model):
        raise InvalidInput(f"model_name is {doc['model_name']!r} but this is model {model!r}; send it to "
                           f"/v2/models/{doc['model_name']}/infer or drop model_name")

    request_id = doc.get("id")
    parameters = doc.get("parameters") or {}
    binary_output = parameters.get("binary_data_output") or False
    raw_inputs = doc["inputs"]
    plans: list[_InputPlan] = []
    seen: set[str] = set()
    for raw in raw_inputs:
        plan = _plan_input(raw, max_elements)
        if plan.name in seen:
            raise InvalidInput(f"duplicate input name '{plan.name}'")
        seen.add(plan.name)
        plans.append(plan)
    outputs = _parse_outputs(doc.get("outputs"))

    # Sizes are all checked against the body before any tensor is built, so a lying
    # header costs nothing but the parse.
    sized = [p for p in plans if p.binary_size is not None]
    declared = sum(p.binary_size or 0 for p in sized)
    if sized and header_length is None:
        raise InvalidInput(
            f"input '{sized[0].name}' has parameters.binary_data_size but the request "
            f"has no {HEADER_LENGTH} header"
        )
    if declared != len(binary):
        longer = "longer" if len(binary) > declared else "shorter"
        raise InvalidInput(
            f"binary tensor data is {len(binary)} bytes, {longer} than the {declared} "
            "bytes the inputs declare in parameters.binary_data_size"
        )

    inputs, offset = [], 0
    for plan in plans:
        if plan.binary_size is not None:
            chunk = binary[offset : offset + plan.binary_size]
            offset += plan.binary_size
            tensor = tensor_from_bytes(plan.name, plan.datatype, plan.shape, chunk)
        else:
            tensor = tensor_from_json(plan.name, plan.datatype, plan.shape, plan.data)
        inputs.append(InferInput(plan.name, plan.datatype, plan.shape, tensor))
    return InferRequest(
        id=request_id,
        inputs=inputs,
        outputs=outputs,
        binary_output=binary_output,
        parameters=parameters,
    )


def encode_infer_response(
    *,
    model_name: str,
    model_version: str | None,
    request_id: str | None,
    outputs: list[tuple[str, torch.Tensor]],
    request: InferRequest | None,
) -> tuple[bytes, dict[str, str]]:
    """Encode model outputs as an OIP v2 REST infer response; returns (body, headers).

    If `request` names outputs, only those are returned, in its order (an unknown name
    raises `InvalidInput`). Outputs the request wants in binary (per-output
    `binary_data`, else request-level `binary_data_output`) carry
    `parameters.binary_data_size` and their bytes follow the JSON header, whose length
    is then given in the `Inference-Header-Content-Length` header. JSON `data` is flat
    and row-major, as Triton returns it. `request_id` defaults to the request's id.
    """
    outputs = select_outputs(request, outputs, model_name)
    if request_id is None and request is not None:
        request_id = request.id
    return encode_response(InferResponse(model_name, model_version, request_id, outputs))


def encode_response(response: InferResponse) -> tuple[bytes, dict[str, str]]:
    """Encode the data plane's answer as an OIP v2 REST body; returns (body, headers)."""
    entries: list[dict[str, Any]] = []
    chunks: list[bytes] = []
    for output in response.outputs:
        flat = output.tensor.detach().cpu().contiguous().reshape(-1)
        entry: dict[str, Any] = {"name": output.name, "datatype": output.datatype,
                                 "shape": list(output.tensor.shape)}
        if output.binary:
            raw = flat.view(torch.uint8).numpy().tobytes()
            entry["parameters"] = {"binary_data_size": len(raw)}
            chunks.append(raw)
        else:
            entry["data"] = flat.tolist()  # FP16/BF16 come out as Python floats
        entries.append(entry)

    doc: dict[str, Any] = {"model_name": response.model_name}
    if response.model_version:
        doc["model_version"] = response.model_version
    if response.id is not None:
        doc["id"] = response.id
    doc["outputs"] = entries
    header = json.dumps(doc, separators=(",", ":")).encode("utf-8")
    if not chunks:
        return header, {"Content-Type": "application/json"}
    return header + b"".join(chunks), {
        "Content-Type": "application/octet-stream",
        HEADER_LENGTH: str(len(header)),
    }


# --- request header ------------------------------------------------------------------


def _header_length(headers: Mapping[str, str], body_length: int) -> int | None:
    target = HEADER_LENGTH.lower()
    values = {
        value.decode("latin-1") if isinstance(value, bytes) else str(value)
        for key, value in headers.items()
        if isinstance(key, str) and key.lower() == target
    }
    if not values:
        return None
    if len(values) > 1:
        raise InvalidInput(f"conflicting {HEADER_LENGTH} headers: {sorted(values)}")
    text = values.pop().strip()
    if re.fullmatch(r"-[0-9]+", text):
        raise InvalidInput(f"{HEADER_LENGTH} must not be negative, got {text}")
    if not re.fullmatch(r"[0-9]+", text):
        raise InvalidInput(f"{HEADER_LENGTH} must be an integer, got {text[:40]!r}")
    # The digit count bound keeps int() away from Python's huge-integer guard.
    if len(text) > 20 or int(text) > body_length:
        raise InvalidInput(
            f"{HEADER_LENGTH} is {text[:40]} but the request body is only {body_length} bytes"
        )
    return int(text)


def _load_json(raw: bytes, header_length: int | None) -> Any:
    # A binary request's JSON is only its first header_length bytes: say so, since a
    # wrong length is the likelier mistake than bad JSON.
    what = "request body" if header_length is None else f"request JSON header (the first {HEADER_LENGTH} bytes)"
    try:
        return load_json(raw)
    except InvalidInput:  # a duplicate key, named by the schema's parser
        raise
    except ValueError as exc:
        try:  # the parser refuses bad UTF-8 too; decoding names the byte, on this path only
            raw.decode("utf-8")
        except UnicodeDecodeError as bad:
            raise InvalidInput(f"{what} is not valid UTF-8 ({bad.reason} at byte {bad.start})") from None
        if str(exc).startswith(DEEPEST):
            raise InvalidInput(f"{what} is nested too deeply") from None
        raise InvalidInput(f"{what} is not valid JSON: {exc}") from None


def _plan_input(raw: dict[str, Any], max_elements: int) -> _InputPlan:
    # check_request has settled every field's JSON type.
    name, datatype = raw["name"], raw["datatype"]
    label = f"input '{name}'"
    check_datatype(datatype, label)
    shape = check_shape(raw["shape"], label, max_elements)
    parameters = raw.get("parameters") or {}
    if "shared_memory_region" in parameters:
        raise InvalidInput(f"{label}: shared memory inputs are not supported; send the data")
    binary_size = parameters.get("binary_data_size")
    has_data = raw.get("data") is not None  # null means absent, as for every optional field
    if has_data and binary_size is not None:
        raise InvalidInput(f"{label} has both 'data' and parameters.binary_data_size; give one")
    if not has_data and binary_size is None:
        raise InvalidInput(f"{label} has no data: give 'data' or parameters.binary_data_size")
    if binary_size is not None:
        needed = prod(shape) * datatype_itemsize(datatype)
        if binary_size != needed:
            raise InvalidInput(
                f"{label}: binary_data_size is {binary_size!r} but shape "
                f"{format_shape(shape)} of {datatype} needs {needed} bytes"
            )
    return _InputPlan(name, datatype, shape, raw.get("data"), binary_size)


def check_datatype(datatype: str, label: str) -> None:
    """Refuse a datatype this server has no tensor for (any protocol's input `label`)."""
    if datatype in UNSUPPORTED_DATATYPES:
        raise InvalidInput(
            f"{label}: datatype {datatype} is not supported; use one of {_SUPPORTED}"
        )
    if datatype not in DATATYPE_TO_TORCH:
        raise InvalidInput(f"{label}: unknown datatype {datatype[:40]!r}; use one of {_SUPPORTED}")


def check_shape(raw: list[int], label: str, max_elements: int) -> tuple[int, ...]:
    """The shape of input `label`, refused when negative, too deep or past `max_elements`."""
    if len(raw) > MAX_RANK:
        raise InvalidInput(f"{label}: shape has {len(raw)} dimensions, more than {MAX_RANK}")
    for axis, dim in enumerate(raw):
        if dim < 0:
            raise InvalidInput(
                f"{label}: shape dimension {axis} is {describe(dim)}; "
                "dimensions must be non-negative integers"
            )
    # Zero-sized dims are skipped so that e.g. [0, 2**40, 2**40] cannot overflow
    # torch's stride arithmetic; this checks the product before anything is allocated.
    span = 1
    for dim in raw:
        span *= max(dim, 1)
        if span > max_elements:
            raise InvalidInput(
                f"{label}: shape {format_shape(raw)} has more than max_elements="
                f"{max_elements} elements, the most one input of this model holds; "
                "send fewer rows per request"
            )
    return tuple(raw)


def _parse_outputs(raw: Any) -> list[RequestedOutput] | None:
    # An empty list means the same as no list: the client named no outputs.
    if raw is None or raw == []:
        return None
    outputs: list[RequestedOutput] = []
    seen: set[str] = set()
    for item in raw:
        name = item["name"]
        label = f"requested output '{name}'"
        if name in seen:
            raise InvalidInput(f"duplicate requested output '{name}'")
        seen.add(name)
        parameters = item.get("parameters") or {}
        binary = parameters.get("binary_data")
        for unsupported in ("shared_memory_region", "classification"):
            if unsupported in parameters:
                raise InvalidInput(f"{label}: parameter '{unsupported}' is not supported")
        outputs.append(RequestedOutput(name, binary, parameters))
    return outputs
