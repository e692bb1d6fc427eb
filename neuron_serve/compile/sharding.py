"""One compiled program over a group of cores: weights and state split by a sharding plan (SPMD).

torch-xla's SPMD (``torch_xla.distributed.spmd``) compiles one program for a ``Mesh`` of
devices from tensors annotated with how they are split (``mark_sharding``); XLA's
partitioner splits every operation accordingly and inserts the collectives (the
all-reduce after a row-split product). A :class:`Sharding` says, for a subgraph's
weights by name and for its state inputs, which dimension is split over the group's
``devices``; :class:`~neuron_serve.compile.subgraph.CompiledSubgraph` applies it to
its resident weights and inputs before tracing. A tensor the plan does not name is
replicated: the program stays correct whatever the plan says, the plan only decides
what each core holds and how much crosses between cores.

Compiling under a plan is scoped with :func:`sharded` (the generation builder wraps
``bucket_model_trace`` in it), so the trace pipeline between the two needs no new
parameter. SPMD is a mode of the whole process and its mesh must cover every device
of the process: a tensor-parallel group runs in a process of its own (one per group,
as vLLM on Neuron runs a worker per group), whose devices are exactly the group's cores.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import os
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch

from ..targets import xla_state
from ..targets.pjrt import emulated, xla

logger = logging.getLogger("neuron_serve")

AXIS = "tp"
Spec = tuple  # per dimension: AXIS (split over the group) or None (whole on every core)

_current: contextvars.ContextVar["Sharding | None"] = contextvars.ContextVar("sharding", default=None)


@dataclass(frozen=True)
class Sharding:
    """How one program's tensors are split over ``devices`` cores.

    ``weights`` maps a weight's qualified name in the traced module (``lm.model.layers.0.
    self_attn.q_proj.weight``) to its spec; ``state`` is the spec of every state input
    (the KV cache: split by key/value heads, dimension 1), None to replicate it.
    """

    devices: int
    weights: dict[str, Spec] = field(default_factory=dict)
    state: Spec | None = None

    def spec_of(self, name: str, derived: dict[str, tuple] | None = None) -> Spec | None:
        """The spec of attribute ``name`` of a compiled subgraph: its own, or its source's moved through the
        layout op that derived it (:mod:`~neuron_serve.compile.passes.fold_weight_layout` records them)."""
        if derived and name in derived:
            source, op, args = derived[name]
            spec = self.spec_of(source, derived)
            return None if spec is None else permuted(spec, op, args)
        return self.weights.get(name)

    def describe(self) -> dict:
        """JSON-ready: the group's size and every split weight with its spec."""
        return {"tensor_parallel_size": self.devices, "state": _spec_text(self.state),
                "weights": {name: _spec_text(spec) for name, spec in sorted(self.weights.items())}}


def _spec_text(spec: Spec | None) -> str:
    return "replicated" if spec is None else "(" + ", ".join(s or "-" for s in spec) + ")"


def permuted(spec: Spec, op: str, args: tuple) -> Spec:
    """``spec`` of a tensor after layout op ``op`` (``t``, ``transpose`` or ``permute``) with ``args``."""
    if op == "t":
        return tuple(reversed(spec))
    if op == "transpose":
        dims = list(spec)
        a, b = (d % len(dims) for d in args[:2])
        dims[a], dims[b] = dims[b], dims[a]
        return tuple(dims)
    if op == "permute":
        return tuple(spec[d % len(spec)] for d in args[0])
    raise ValueError(f"no spec rule for layout op {op}")


@contextlib.contextmanager
def sharded(plan: Sharding | None) -> Iterator[None]:
    """Within the block, compiled subgraphs are one program over ``plan.devices`` cores (None: one core)."""
    token = _current.set(plan)
    try:
        yield
    finally:
        _current.reset(token)


def current() -> Sharding | None:
    """The plan :func:`sharded` set for this context, if any."""
    return _current.get()


def start_spmd(devices: int) -> None:
    """Put this process's XLA runtime in SPMD mode over ``devices`` cores, before any tensor is on a core.

    Emulated, the cores are ``devices`` XLA:CPU devices (``CPU_NUM_DEVICES``); on Neuron,
    the NeuronCores ``NEURON_RT_VISIBLE_CORES`` gives the process. Refused when the runtime
    already runs another way: SPMD and the mesh are the process's, not a model's.
    """
    torch_xla = xla()
    import torch_xla.runtime as xr  # noqa: PLC0415

    if xr.is_spmd():
        if xr.global_runtime_device_count() != devices:
            raise RuntimeError(f"this process runs SPMD over {xr.global_runtime_device_count()} cores, not "
                               f"{devices}; a tensor-parallel group needs a process whose cores are the group's")
        return
    if torch_xla._XLAC._xla_runtime_is_initialized():
        count = xr.global_runtime_device_count()
        if count != devices:
            raise RuntimeError(
                f"tensor_parallel_size {devices}: this process's XLA runtime already runs over {count} core(s); "
                f"a tensor-parallel group needs a process whose cores are exactly the group's. Build the engine "
                f"before any other XLA work in the process (with CPU_NUM_DEVICES={devices} when emulated), or "
                f"serve the model (each group then runs in a process of its own).")
    elif emulated() and int(os.environ.get("CPU_NUM_DEVICES", "1")) != devices:
        os.environ["CPU_NUM_DEVICES"] = str(devices)
    # torch-xla's dynamo bridge re-traces a compiled graph when an input's sharding differs from the one it was
    # traced with; the re-trace matches inputs by the id of the tensor that first held their data, so a state
    # tensor whose data an earlier call's output replaced (DeviceState.update) is taken for a constant and frozen
    # at its value then (LoRA buffers read as zeros at every later decode). Inputs are given the layout each
    # executable was compiled for instead (CompiledSubgraph._layouts, the plan's state spec), so the check is off.
    os.environ["XLA_DYNAMO_INPUT_SHARDING_CHECK_THRESHOLD"] = "0"
    xr.use_spmd()
    if xr.global_runtime_device_count() != devices:
        raise RuntimeError(f"tensor_parallel_size {devices}: the process has {xr.global_runtime_device_count()} "
                           f"core(s); give it exactly the group's cores")


def mesh(devices: int) -> Any:
    """The 1-D mesh of a group's ``devices`` cores, axis ``tp``."""
    import numpy as np  # noqa: PLC0415
    import torch_xla.distributed.spmd as xs  # noqa: PLC0415

    return xs.Mesh(np.arange(devices), (devices,), (AXIS,))


def mark(tensor: torch.Tensor, spec: Spec | None, devices: int) -> None:
    """Annotate ``tensor`` (on the SPMD device) as split by ``spec``, or replicated when None."""
    import torch_xla.distributed.spmd as xs  # noqa: PLC0415

    with xla_state.exclusive():  # a tensor already on the group is laid out anew: device work
        xs.mark_sharding(tensor, mesh(devices), spec if spec is not None else (None,) * tensor.dim())


def layout(spec: Spec, example: torch.Tensor, devices: int) -> Any:
    """The layout of a tensor shaped as ``example`` split by ``spec``, to place a host tensor on the group split
    as it moves (``_xla_tensors_from_aten``'s shardings)."""
    import torch_xla.distributed.spmd as xs  # noqa: PLC0415

    return xs.ShardingSpec(mesh(devices), tuple(spec)).xla_spec(example)


def apply_to_module(module: torch.nn.Module, plan: Sharding, derived: dict[str, tuple]) -> None:
    """Mark every parameter and buffer of ``module`` (on the SPMD device) by ``plan``."""
    for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
        spec = plan.spec_of(name, derived)
        if spec is not None and len(spec) != tensor.dim():
            raise ValueError(f"sharding spec {spec} of {name} does not fit its shape {tuple(tensor.shape)}")
        mark(tensor, spec, plan.devices)
