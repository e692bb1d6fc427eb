"""The protocol-neutral infer request and response the data plane takes and returns.

Every protocol codec (OIP REST JSON and binary, OIP gRPC; later OpenAI and the generate
extension) decodes into `InferRequest` and encodes from `InferResponse`, so no protocol
is translated into another on the way. Tensors are CPU tensors that may share memory
with the request's wire buffer (numpy views made with ``np.frombuffer``); nothing here
writes into them. Also the OIP v2 datatype tables, the spec a model declares for its
inputs, and the checks of a request against that spec, common to every protocol.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from neuron_serve.errors import ConfigError, InvalidInput, NeuronServeError

DATATYPE_TO_TORCH: dict[str, torch.dtype] = {
    "BOOL": torch.bool,
    "UINT8": torch.uint8,
    "INT8": torch.int8,
    "INT16": torch.int16,
    "INT32": torch.int32,
    "INT64": torch.int64,
    "FP16": torch.float16,
    "FP32": torch.float32,
    "FP64": torch.float64,
    "BF16": torch.bfloat16,
}
TORCH_TO_DATATYPE: dict[torch.dtype, str] = {v: k for k, v in DATATYPE_TO_TORCH.items()}

# Protocol datatypes that exist but have no tensor here (BYTES are strings; torch's
# wide unsigned ints have too few kernels to be useful). Named separately so a client
# is told the type is refused on purpose, not that it is misspelled.
UNSUPPORTED_DATATYPES = frozenset({"BYTES", "UINT16", "UINT32", "UINT64"})

INTEGER_DATATYPES = frozenset({"UINT8", "INT8", "INT16", "INT32", "INT64"})


def datatype_itemsize(datatype: str) -> int:
    """Bytes per element of `datatype` in the binary tensor data extension."""
    return DATATYPE_TO_TORCH[datatype].itemsize


def format_shape(shape: tuple[int, ...] | list[Any]) -> str:
    """A shape as the protocol writes it, `[2, -1]`, for error messages."""
    return "[" + ", ".join(str(d) for d in shape) + "]"


@dataclass
class InferInput:
    """One input tensor of a request, already decoded to a CPU tensor of `shape`.

    The tensor may be a view of the request's bytes (read-only memory): consumers copy
    before writing, as the runtime does when it batches rows.
    """

    name: str
    datatype: str
    shape: tuple[int, ...]
    tensor: torch.Tensor


@dataclass
class RequestedOutput:
    """An output the client asked for; `binary_data` None means "request default"."""

    name: str
    binary_data: bool | None = None
    parameters: dict[str, Any] = field(default_factory=dict)


@dataclass
class InferRequest:
    """A decoded infer request, whatever protocol carried it.

    `outputs` is None when the client named no outputs (return all of them);
    `binary_output` is the request-level default for outputs that say nothing (REST's
    `binary_data_output`; gRPC answers in raw bytes always).
    """

    id: str | None
    inputs: list[InferInput]
    outputs: list[RequestedOutput] | None = None
    binary_output: bool = False
    parameters: dict[str, Any] = field(default_factory=dict)


@dataclass
class TensorSpec:
    """An input a model accepts: its name, datatype, and shape with -1 for any size."""

    name: str
    datatype: str
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        # A bad spec is a deployment mistake, caught when the model is declared
        # rather than on the first request.
        if self.datatype not in DATATYPE_TO_TORCH:
            raise ConfigError(
                f"TensorSpec {self.name!r}: datatype {self.datatype!r} is not one of "
                f"{', '.join(DATATYPE_TO_TORCH)}"
            )
        self.shape = tuple(self.shape)
        if any(type(d) is not int or d < -1 for d in self.shape):
            raise ConfigError(
                f"TensorSpec {self.name!r}: shape {format_shape(self.shape)} must hold "
                "non-negative integers, or -1 for any size"
            )


@dataclass
class InferOutput:
    """One output tensor of an answer, and whether the client wants it as raw bytes."""

    name: str
    datatype: str
    tensor: torch.Tensor
    binary: bool = False


@dataclass
class InferResponse:
    """The data plane's answer: the outputs the request selected, in its order."""

    model_name: str
    model_version: str | None
    id: str | None
    outputs: list[InferOutput]


def select_outputs(request: InferRequest | None, produced: list[tuple[str, torch.Tensor]],
                   model_name: str) -> list[InferOutput]:
    """The outputs `request` asked for (all, when it named none), with their binary flag.

    An unknown name raises `InvalidInput`; an output dtype no protocol can carry raises
    `NeuronServeError` (500: the model produced it, not the client).
    """
    default_binary = request.binary_output if request is not None else False
    selected: list[tuple[str, torch.Tensor, bool]] = []
    if request is not None and request.outputs:
        by_name = dict(produced)
        for wanted in request.outputs:
            if wanted.name not in by_name:
                raise InvalidInput(
                    f"requested output '{wanted.name}' is not an output of model "
                    f"'{model_name}'; its outputs are: {', '.join(by_name) or '(none)'}"
                )
            binary = default_binary if wanted.binary_data is None else wanted.binary_data
            selected.append((wanted.name, by_name[wanted.name], binary))
    else:
        selected = [(name, tensor, default_binary) for name, tensor in produced]
    outputs = []
    for name, tensor, binary in selected:
        datatype = TORCH_TO_DATATYPE.get(tensor.dtype)
        if datatype is None:
            raise NeuronServeError(
                f"output '{name}' has dtype {tensor.dtype}, which the protocol cannot carry; "
                f"cast it to one of {', '.join(DATATYPE_TO_TORCH)}"
            )
        outputs.append(InferOutput(name, datatype, tensor, binary))
    return outputs


def check_inputs(inputs: list[InferInput], expected: list[TensorSpec]) -> list[torch.Tensor]:
    """Match request inputs to a model's declared inputs; tensors in `expected` order.

    Raises `InvalidInput` for an unknown, duplicate or missing input, a wrong datatype,
    or a shape whose rank or fixed (non -1) dimensions differ from the spec.
    """
    specs = {spec.name: spec for spec in expected}
    names = ", ".join(spec.name for spec in expected) or "(none)"
    given: dict[str, InferInput] = {}
    for inp in inputs:
        if inp.name not in specs:
            raise InvalidInput(f"unknown input '{inp.name}'; the model expects: {names}")
        if inp.name in given:
            raise InvalidInput(f"duplicate input name '{inp.name}'")
        given[inp.name] = inp
    for spec in expected:
        inp = given.get(spec.name)
        if inp is None:
            raise InvalidInput(f"missing input '{spec.name}'; the model expects: {names}")
        if inp.datatype != spec.datatype:
            raise InvalidInput(
                f"input '{spec.name}' has datatype {inp.datatype}; expected {spec.datatype}"
            )
        shape = tuple(inp.tensor.shape)
        if len(shape) != len(spec.shape) or any(
            want != -1 and want != got for want, got in zip(spec.shape, shape, strict=True)
        ):
            raise InvalidInput(
                f"input '{spec.name}' has shape {format_shape(shape)}; "
                f"expected {format_shape(spec.shape)}"
            )
    return [given[spec.name].tensor for spec in expected]
