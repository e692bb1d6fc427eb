"""Weights on a core, held once whatever the number of executables that take them.

An executable compiled with its weights lifted into inputs (``inline_weights_to_neff=False``;
every generate and pooling model) is handed its weights on each call. Each compiled model
of a model (a prefill or decode bucket, a batch size, a sampled variant) takes the same
weights, so they are placed on a core once and every executable there takes the same device
tensors: a bucket costs its code, not a copy of the checkpoint (NxD Inference's shared
weights; torch-neuronx's ``inline_weights_to_neff=False`` with ``replace_weights``).

The store is the process's: a host tensor (by its storage, offset, shape and strides) in a
layout (as is, or transposed once for the matrix multiplications that read it) on a device,
split by a sharding spec or whole, is copied there once and shared for as long as an
executable holds it. New host tensors (another checkpoint swapped in) are placed anew; the
old device copies go when nothing holds them. :func:`held_bytes` is what the store holds.

Emulated, a core's memory is this process's own, so the host copy of a weight that one core
holds whole can be that core's copy itself: :func:`share_with_host` makes each such host tensor
a view of the core's buffer (DLPack, no copy), and the model's copy of record can then go, so the
process holds each weight once, not twice.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Iterable, Sequence

import torch

from . import sharding as spmd
from ..targets import xla_state


class HeldWeight:
    """One weight on one device: the host tensor it was copied from (kept, so its storage is not reused while
    the copy is keyed by it) and the device tensor every executable takes."""

    __slots__ = ("host", "tensor", "device", "key", "spec", "devices", "__weakref__")

    def __init__(self, host: torch.Tensor, tensor: torch.Tensor, device: str, key: tuple,
                 spec: spmd.Spec | None = None, devices: int = 1) -> None:
        self.host = host
        self.tensor = tensor
        self.device = device
        self.key = key
        self.spec = spec  # how it is split over the group's ``devices`` cores (None: whole on each)
        self.devices = devices

    @property
    def nbytes(self) -> int:
        """Bytes of the whole tensor."""
        return self.tensor.numel() * self.tensor.element_size()

    @property
    def share(self) -> int:
        """Bytes one core of the group holds: its split of the tensor, or all of it."""
        if self.spec is None or spmd.AXIS not in self.spec:
            return self.nbytes
        dim = self.spec.index(spmd.AXIS)
        size = self.tensor.shape[dim]
        return self.nbytes // size * -(-size // self.devices)


_HELD: "weakref.WeakValueDictionary[tuple, HeldWeight]" = weakref.WeakValueDictionary()
_LOCK = threading.Lock()


def _key(host: torch.Tensor, transposed: bool, device: Any, spec: spmd.Spec | None) -> tuple:
    storage = host.untyped_storage()
    return (storage.data_ptr(), storage.nbytes(), host.storage_offset(), tuple(host.shape), tuple(host.stride()),
            host.dtype, transposed, str(device), spec)


def hold(weights: Sequence[torch.Tensor], transposed: set[int], device: Any,
         specs: Sequence[spmd.Spec | None] | None = None, devices: int = 1) -> list[HeldWeight]:
    """``weights`` (host tensors) on ``device`` as an executable takes them: those at ``transposed`` indices
    transposed, each split by ``specs[i]`` over ``devices`` cores (None: whole). A weight already held there in
    that layout is shared, not copied again."""
    held: list[HeldWeight] = []
    for index, host in enumerate(weights):
        host = host.detach()
        flip = index in transposed
        spec = specs[index] if specs is not None else None
        key = _key(host, flip, device, spec)
        with _LOCK:
            found = _HELD.get(key)
        if found is None:
            with torch.no_grad(), xla_state.exclusive():
                tensor = (host.t().contiguous() if flip else host).to(device)
                if spec is not None:
                    spmd.mark(tensor, spec, devices)
            made = HeldWeight(host, tensor, str(device), key, spec, devices)
            with _LOCK:  # another thread may have placed it meanwhile: keep the first
                found = _HELD.setdefault(key, made)
        held.append(found)
    return held


def identity(tensor: torch.Tensor) -> tuple:
    """What makes two host tensors the same weight: their storage, offset, shape, strides and dtype."""
    return _key(tensor, False, None, None)[:6]


def share_with_host(weights: Iterable[HeldWeight]) -> dict[tuple, torch.Tensor]:
    """Emulated cores: make the host tensor of each of ``weights`` that its core holds whole a view of that core's
    buffer, in the weight's own layout (transposed back where the core holds it transposed), so host and core hold
    one copy. Returns each old host tensor's :func:`identity` -> its view, for the caller to hand to whatever held
    the old one (the model's modules, the compiled models' records of their weights): once nothing does, the
    old copy is freed. Weights split over a group of cores (a sharding spec), and real NeuronCores, keep theirs."""
    from ..targets.pjrt import emulated  # noqa: PLC0415

    if not emulated():
        return {}
    from torch_xla.utils import dlpack  # noqa: PLC0415

    views: dict[tuple, torch.Tensor] = {}
    for weight in {id(w): w for w in weights}.values():
        if weight.spec is not None or weight.devices != 1:
            continue
        old = identity(weight.host)
        if old not in views:
            try:
                with xla_state.exclusive():
                    core = torch.from_dlpack(dlpack.to_dlpack(weight.tensor))
            except RuntimeError:  # a dtype DLPack cannot express (float8): this weight keeps its host copy
                continue
            transposed = weight.key[6]
            views[old] = core.t() if transposed else core
        view = views[old]
        key = _key(view, weight.key[6], weight.device, weight.spec)
        with _LOCK:
            if _HELD.get(weight.key) is weight:
                del _HELD[weight.key]
            weight.key, weight.host = key, view
            _HELD.setdefault(key, weight)
    return views


def held() -> list[HeldWeight]:
    """Every weight the process holds on a device now."""
    with _LOCK:
        return list(_HELD.values())


def held_bytes(device: str | None = None) -> int:
    """Bytes of weights the process holds on ``device`` (every device with None), each weight once."""
    return sum(w.nbytes for w in held() if device is None or w.device == device)
