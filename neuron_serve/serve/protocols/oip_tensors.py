"""Tensor data of Open Inference Protocol v2 requests: JSON `data` lists and binary chunks.

Helpers of the OIP codecs (`oip_rest`, `oip_grpc`). Callers have already checked the shape against
the element limit and, for binary data, the chunk length against the shape, so nothing
here allocates more than the request declared.
"""

from __future__ import annotations

from collections.abc import Callable
from math import prod
from typing import Any

import numpy as np
import torch

from neuron_serve.errors import InvalidInput
from neuron_serve.serve.protocols.infer import DATATYPE_TO_TORCH, INTEGER_DATATYPES, format_shape


_NUMPY_FLOATS = {torch.float16: np.float16, torch.float32: np.float32, torch.float64: np.float64}


def json_type(value: Any) -> str:
    """How a decoded JSON value is named in error messages ("a list", "null")."""
    names = {dict: "an object", list: "a list", str: "a string", bool: "a boolean"}
    names.update({int: "a number", float: "a number", type(None): "null"})
    return names.get(type(value), type(value).__name__)


def describe(value: Any) -> str:
    """A bounded rendering of a client's value for an error message."""
    text = repr(value)
    text = text if len(text) <= 40 else text[:37] + "..."
    return f"{text} ({json_type(value)})"


def tensor_from_json(name: str, datatype: str, shape: tuple[int, ...], data: Any) -> torch.Tensor:
    """Build the tensor of input `name` from its JSON `data` (flat or nested, row-major).

    Raises `InvalidInput` on a wrong element count, a wrong element type (a float in
    integer data, a non-bool in BOOL data, a non-number in float data) or a value out
    of the datatype's range. NaN and Infinity are accepted for float datatypes only.
    """
    label = f"input '{name}'"
    flat = _flatten(data, label)
    expected = prod(shape)
    if len(flat) != expected:
        raise InvalidInput(
            f"{label}: shape {format_shape(shape)} needs {expected} elements "
            f"in 'data', got {len(flat)}"
        )
    dtype = DATATYPE_TO_TORCH[datatype]
    if dtype.is_floating_point and set(map(type, flat)) <= {float}:
        # The common case, checked by C loops alone: the per-element checks below
        # are a large share of a small model's request time.
        # numpy converts a list of floats about three times faster than torch.tensor (BF16 has no numpy type).
        as_numpy = _NUMPY_FLOATS.get(dtype)
        tensor = torch.from_numpy(np.array(flat, dtype=as_numpy)) if as_numpy else torch.tensor(flat, dtype=dtype)
        return tensor.reshape(shape)
    if datatype == "BOOL":
        _check_elements(flat, lambda v: type(v) is bool, label, "BOOL data must be true or false")
    elif datatype in INTEGER_DATATYPES:
        # Floats (NaN included) are refused rather than truncated: a client sending
        # 1.5 to an integer input has a bug worth hearing about.
        _check_elements(flat, lambda v: type(v) is int, label, f"{datatype} data must be integers")
        info = torch.iinfo(dtype)
        for index, value in enumerate(flat):
            if not info.min <= value <= info.max:
                raise InvalidInput(
                    f"{label}: element {index} = {describe(value)} is out of range for "
                    f"{datatype} [{info.min}, {info.max}]"
                )
    else:
        _check_elements(
            flat, lambda v: type(v) in (int, float), label, f"{datatype} data must be numbers"
        )
        for index, value in enumerate(flat):
            if type(value) is int:
                # JSON integers are fine for floats, but 10**400 has no float value.
                try:
                    flat[index] = float(value)
                except OverflowError:
                    raise InvalidInput(
                        f"{label}: element {index} = {describe(value)} is out of range "
                        f"for {datatype}"
                    ) from None
    return torch.tensor(flat, dtype=dtype).reshape(shape)


def tensor_from_bytes(
    name: str, datatype: str, shape: tuple[int, ...], chunk: memoryview
) -> torch.Tensor:
    """Build the tensor of input `name` from its binary chunk (exactly the right length).

    BOOL bytes other than 0 and 1 raise `InvalidInput`.
    """
    dtype = DATATYPE_TO_TORCH[datatype]
    if len(chunk) == 0:  # torch.frombuffer refuses empty buffers
        return torch.empty(shape, dtype=dtype)
    # One copy into a writable buffer the tensor owns, so the body can be freed and
    # torch does not warn about read-only memory. The wire format is little-endian,
    # as is every platform torch ships for.
    buffer = bytearray(chunk)
    if dtype is torch.bool:
        # Any other byte would be an invalid torch.bool; refuse rather than guess.
        raw = torch.frombuffer(buffer, dtype=torch.uint8)
        bad = (raw > 1).nonzero()
        if len(bad):
            index = int(bad[0])
            raise InvalidInput(
                f"input '{name}': BOOL binary data must be bytes 0 or 1; "
                f"byte {index} is {int(raw[index])}"
            )
        return raw.view(torch.bool).reshape(shape)
    return torch.frombuffer(buffer, dtype=dtype).reshape(shape)


def _flatten(data: Any, label: str) -> list[Any]:
    if not isinstance(data, list):
        raise InvalidInput(f"{label}: 'data' must be a list, got {json_type(data)}")
    if list not in set(map(type, data)):
        return list(data)  # already flat
    # Iterative, since nesting depth is bounded only by the JSON parser.
    flat: list[Any] = []
    stack = [iter(data)]
    while stack:
        for item in stack[-1]:
            if isinstance(item, list):
                stack.append(iter(item))
                break
            flat.append(item)
        else:
            stack.pop()
    return flat


def _check_elements(flat: list[Any], ok: Callable[[Any], bool], label: str, rule: str) -> None:
    for index, value in enumerate(flat):
        if not ok(value):
            raise InvalidInput(f"{label}: {rule}; element {index} is {describe(value)}")
