"""Open Inference Protocol v2 (KServe v2 / Triton HTTP) datatypes and request types.

Plain data shared by the codec (`neuron_serve.serve.oip`) and the serving layers: the
datatype tables, a parsed request, and the spec a model declares for its inputs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from neuron_serve.errors import ConfigError

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
    return torch.empty((), dtype=DATATYPE_TO_TORCH[datatype]).element_size()


def format_shape(shape: tuple[int, ...] | list[Any]) -> str:
    """A shape as the protocol writes it, `[2, -1]`, for error messages."""
    return "[" + ", ".join(str(d) for d in shape) + "]"


@dataclass
class InferInput:
    """One input tensor of a request, already decoded to a CPU tensor of `shape`."""

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
    """A parsed infer request.

    `outputs` is None when the client named no outputs (return all of them);
    `binary_output` is the request-level `binary_data_output` parameter.
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
