"""Typed errors a user can cause, and how each surfaces over HTTP and on the CLI.

Each error subclasses the builtin that torch-neuronx raises for the same situation
(ValueError for bad configuration and partitioner rule violations), so code written
against torch_neuronx keeps catching what it caught before.
"""

from __future__ import annotations


class NeuronServeError(Exception):
    """Base of every error neuron-serve raises on purpose."""

    http_status = 500
    exit_code = 1


class ConfigError(NeuronServeError, ValueError):
    """A configuration value is invalid; the message names the field and the fix."""

    http_status = 400
    exit_code = 2


class PartitionError(NeuronServeError, ValueError):
    """The partition plan breaks a PartitionerConfig rule."""

    exit_code = 3


class UnsupportedModelError(NeuronServeError, RuntimeError):
    """The model has operators the target cannot run and partitioning is off."""

    exit_code = 3


class InternalCompileError(NeuronServeError, RuntimeError):
    """torch-xla failed for a reason of its own (its process state, memory, an interrupt) while compiling or
    probing, twice: once, then again in a clean state. Not the model's operators: the message names what was
    being compiled and torch-xla's words; nothing of it is cached."""

    exit_code = 5
    internal = True


class InvalidInput(NeuronServeError, ValueError):
    """Inputs do not match what the compiled model accepts; ``field``, when known, is the request field at fault
    (OpenAI's error object names it as ``param``)."""

    http_status = 400

    def __init__(self, message: str = "", field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class AdapterError(InvalidInput):
    """A LoRA adapter cannot be served on its model: unreadable, an option that changes the math, or of another
    base model. The message names the adapter's file, the module and the fix. Refused at start
    (generation.lora.lora_modules) as a configuration error is; a load request gets 400."""

    exit_code = 2


class ModelNotFound(NeuronServeError):
    http_status = 404


class AdapterNotLoaded(ModelNotFound):
    """A request names a LoRA adapter its engine does not serve: unloaded after the replica checked the name and
    before the engine took the request. Answered as an unknown model is."""


class ModelNotReady(NeuronServeError):
    http_status = 503


class HostMemoryExceeded(NeuronServeError):
    """A compile was skipped: the host memory it needs (measured on the compiles of its family) was not there
    for as long as it waited (assembly/host_memory.py). The replica serves on the models it has; a request that
    waited for this compile may be sent again once memory is free."""

    http_status = 503


class PayloadTooLarge(NeuronServeError):
    """The request body passes http.max_request_bytes."""

    http_status = 413


class ArtifactError(NeuronServeError):
    """A saved artifact or cache entry is corrupt or was built by other versions."""

    exit_code = 4


class Overloaded(NeuronServeError):
    """The request queue is full or the server is shutting down; retry later."""

    http_status = 503


class RequestTimeout(NeuronServeError):
    """A request waited longer than its deadline for a result."""

    http_status = 504
