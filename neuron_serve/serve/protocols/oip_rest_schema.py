"""The JSON shape of an OIP v2 infer request, checked before anything reads it.

Pydantic models of the request (the JSON body, or the JSON header of the binary tensor
data extension) in strict mode: every field has one JSON type, so a list where a string
belongs, an object where a number belongs, or a missing required field is refused with
an `InvalidInput` (HTTP 400) naming the field by its path, e.g.
``inputs[0].datatype must be a string, got a list``. The codec (`neuron_serve.serve.protocols.oip_rest`)
then checks what types cannot say: datatypes, shape sizes, data against the datatype.

Choices a client can rely on:
- ``null`` for an optional field means the field is absent (as KServe's own pydantic
  models read it); ``null`` for a required one is refused.
- A key the protocol does not define in the request, an input or an output is refused
  (accepting it would silently ignore it); ``parameters`` objects are open, as the
  protocol lets them carry extension parameters.
- A JSON object with the same key twice is refused naming the key (see `load_json`):
  parsers disagree on which copy wins, so a proxy and the server could read two
  different requests.
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any

import jiter
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, ValidationError, field_validator

from neuron_serve.errors import InvalidInput

# Names echo into error messages and ids into responses: bound them so a hostile
# request cannot make the answer as large as itself.
MAX_NAME_CHARS = 256
MAX_ID_CHARS = 1024

Name = Annotated[StrictStr, Field(min_length=1, max_length=MAX_NAME_CHARS)]


class _Closed(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class _Open(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")


class RequestParameters(_Open):
    """Request-level parameters; the binary extension's one is typed."""

    binary_data_output: StrictBool | None = None


class InputParameters(_Open):
    """Per-input parameters; the binary extension's size is a non-negative integer."""

    binary_data_size: Annotated[StrictInt, Field(ge=0)] | None = None


class OutputParameters(_Open):
    """Per-output parameters."""

    binary_data: StrictBool | None = None


class InputTensor(_Closed):
    """One entry of ``inputs``."""

    name: Name
    shape: list[StrictInt]
    datatype: StrictStr
    parameters: InputParameters | None = None
    # Any here: a data list can hold millions of elements, which the codec checks in
    # one pass against the datatype; only "is it a list" is asked here.
    data: Any = None

    @field_validator("data")
    @classmethod
    def _data_is_list(cls, value: Any) -> Any:
        if value is not None and not isinstance(value, list):
            raise ValueError(f"must be a list, got {_shown(value)}")
        return value


class RequestedOutput(_Closed):
    """One entry of ``outputs``."""

    name: Name
    parameters: OutputParameters | None = None


class InferRequestModel(_Closed):
    """The OIP v2 infer request object."""

    id: Annotated[StrictStr, Field(max_length=MAX_ID_CHARS)] | None = None
    # Not in the protocol's request, but KServe's client sends them; the URL names the model.
    model_name: Name | None = None
    model_version: Name | None = None
    parameters: RequestParameters | None = None
    inputs: list[InputTensor]
    outputs: list[RequestedOutput] | None = None


# jiter (pydantic's JSON parser, in Rust) parses a 784-float body in about a tenth of the
# time of json.loads with a duplicate-key hook, and finds duplicate keys itself.
_DUPLICATE = re.compile(r'^Detected duplicate key "((?:[^"\\]|\\.)*)" at line')
DEEPEST = "recursion limit exceeded"  # jiter's words for nesting past its limit (about 200)


def load_json(raw: bytes) -> Any:
    """Parse JSON, refusing an object with a duplicate key, naming the key.

    NaN and Infinity are accepted (float tensors legitimately hold them, and Python's
    json writes them). Other malformed JSON raises ``ValueError`` with the parser's
    words and position.
    """
    try:
        return jiter.from_json(raw, allow_inf_nan=True, catch_duplicate_keys=True)
    except ValueError as exc:
        duplicate = _DUPLICATE.match(str(exc))
        if duplicate is None:
            raise
        key = json.loads(f'"{duplicate.group(1)}"')
        raise InvalidInput(f"request JSON has the key {_bounded(key)!r} twice in one object; give it once") from None


def check_request(doc: Any) -> None:
    """Raise `InvalidInput` naming the first field whose JSON type is wrong."""
    if not isinstance(doc, dict):
        raise InvalidInput(f"request body must be a JSON object, got {_json_type(doc)}")
    try:
        InferRequestModel.model_validate(doc)
    except ValidationError as exc:
        raise InvalidInput(_describe(exc.errors(include_url=False)[0])) from None


# What each strict type error expects, in the words of JSON.
_EXPECTED = {
    "string_type": "a string",
    "int_type": "an integer",
    "bool_type": "true or false",
    "list_type": "a list",
    "model_type": "an object",
    "model_attributes_type": "an object",
    "dict_type": "an object",
}


def _describe(error: dict[str, Any]) -> str:
    field = _path(error["loc"])
    kind, value = error["type"], error.get("input")
    if kind == "missing":
        return f"{field} is required"
    if kind == "extra_forbidden":
        return f"{field} is not a field of an OIP v2 infer request; remove it"
    if kind in _EXPECTED:
        # A JSON integer too large for Python is parsed already; strict int accepts it.
        return f"{field} must be {_EXPECTED[kind]}, got {_shown(value)}"
    if kind == "string_too_short":
        return f"{field} must not be empty"
    if kind == "string_too_long":
        return f"{field} has {len(value)} characters, more than {error['ctx']['max_length']}"
    if kind == "greater_than_equal":
        return f"{field} must be >= {error['ctx']['ge']}, got {_bounded(value)}"
    if kind == "value_error":
        return f"{field} {error['ctx']['error']}"
    return f"{field}: {error['msg']}"


def _path(loc: tuple[Any, ...]) -> str:
    text = ""
    for part in loc:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text or "request"


def _json_type(value: Any) -> str:
    names = {dict: "an object", list: "a list", str: "a string", bool: "a boolean"}
    names.update({int: "a number", float: "a number", type(None): "null"})
    return names.get(type(value), type(value).__name__)


def _shown(value: Any) -> str:
    if isinstance(value, (dict, list)) or value is None:
        return _json_type(value)
    return f"{_json_type(value)} ({_bounded(json.dumps(value))})"


def _bounded(value: Any) -> str:
    text = str(value)
    return text if len(text) <= 40 else text[:37] + "..."
