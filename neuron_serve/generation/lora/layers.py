"""LoRA on the core: adapter buffers beside the KV cache, and each row's adapter applied inside the call.

Every projection of attention and the MLP that an adapter may target gets two state
tensors, resident on the core like the cache: ``A`` of (slots, in_features, rank) and
``B`` of (slots, rank, out_features), slot 0 all zeros (the base model) and one slot per
adapter the engine holds (``max_loras``), each at ``max_lora_rank`` (a smaller rank is
zero-padded, its scaling folded into B). Every compiled prefill, decode, extend and
verify takes each row's slot as an input and adds, after each targeted projection,

    delta = (x @ A[slot]) @ B[slot]

gathered per row (punica's BGMV, as vLLM and NxD Inference compute multi-LoRA batches):
rows of different adapters and of the base share one call, and loading an adapter only
writes its slot of the buffers (:func:`slot_values`, written by ``DeviceState.write_row``), never compiles.

With tensor parallelism the buffers are kept whole on every core of the group (the plan
splits the KV cache; XLA's partitioner computes each delta beside its split projection).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator, Sequence

import torch

if TYPE_CHECKING:  # the adapter reader (safetensors) only where adapters are read: adapters.py
    from .adapter import LoraAdapter, Projection


@dataclass(frozen=True)
class Layout:
    """The adapter buffers of one model: ``max_loras`` adapters at ``rank``, over every projection an adapter
    may target (``lora.LoraBase.projections``)."""

    max_loras: int
    rank: int
    targets: tuple[Projection, ...]

    @property
    def slots(self) -> int:
        """Buffer slots: the base's (0, all zeros) and one per resident adapter."""
        return self.max_loras + 1

    def shapes(self) -> list[tuple[int, ...]]:
        """Each buffer's shape, in state order: A then B of each target."""
        return [shape for t in self.targets
                for shape in ((self.slots, t.in_features, self.rank), (self.slots, self.rank, t.out_features))]

    @property
    def buffers(self) -> int:
        """State tensors: an A and a B per target."""
        return 2 * len(self.targets)

    def bytes(self, dtype_bytes: int) -> int:
        """Bytes of every buffer (one core holds them whole at tensor_parallel_size 1)."""
        return sum(a * b * c for a, b, c in self.shapes()) * dtype_bytes


def buffers(layout: Layout, dtype: torch.dtype) -> list[torch.Tensor]:
    """Zeroed buffers of ``layout``, in state order."""
    return [torch.zeros(shape, dtype=dtype) for shape in layout.shapes()]


@contextlib.contextmanager
def applied(lm: torch.nn.Module, layout: Layout, states: Sequence[torch.Tensor],
            adapters: torch.Tensor, mixed_rows: int = 0) -> Iterator[None]:
    """While tracing ``lm``: every target's output gets its rows' adapter delta, from ``states`` (the
    buffers, A and B of each target in order) at each row's slot (``adapters``, (rows,)). A mixed call
    (``mixed_rows`` R: one sequence of R decode rows' tokens, then a chunk's) has R + 1 adapters: each row's, then
    the chunk's."""
    modules = dict(lm.named_modules())
    hooks = []
    for i, target in enumerate(layout.targets):
        a, b = states[2 * i], states[2 * i + 1]

        def hook(module, inputs, output, a=a, b=b):
            x = inputs[0]
            if mixed_rows:  # the rows' tokens as rows of one token, the chunk as one row of its tokens
                return output + _mixed_delta(x, a, b, adapters, mixed_rows).to(output.dtype)
            rows = x.shape[0]
            flat = x.reshape(rows, -1, x.shape[-1])  # (rows, tokens, in)
            low = torch.bmm(flat.to(a.dtype), a.index_select(0, adapters))  # (rows, tokens, rank)
            delta = torch.bmm(low, b.index_select(0, adapters))  # (rows, tokens, out)
            return output + delta.reshape(output.shape).to(output.dtype)

        hooks.append(modules[target.module].register_forward_hook(hook))
    try:
        yield
    finally:
        for handle in hooks:
            handle.remove()


def _mixed_delta(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, adapters: torch.Tensor, rows: int) -> torch.Tensor:
    """The adapter delta of a mixed call's tokens x (1, rows + chunk, in): each decode row's under its adapter, the
    chunk's under the last one; (1, rows + chunk, out)."""
    x = x.to(a.dtype)
    decoded = torch.bmm(torch.bmm(x[0, :rows, None], a.index_select(0, adapters[:rows])),
                        b.index_select(0, adapters[:rows]))  # (rows, 1, out)
    chunk = torch.bmm(torch.bmm(x[:, rows:], a.index_select(0, adapters[rows:])), b.index_select(0, adapters[rows:]))
    return torch.cat([decoded.reshape(1, rows, -1), chunk], dim=1)


def slot_values(layout: Layout, adapter: LoraAdapter | None) -> list[torch.Tensor]:
    """What one slot of the buffers holds for ``adapter`` (None: zeros, the base), in state order: each
    target's A (in, R) and B (R, out); a projection the adapter does not target holds zeros."""
    values = []
    for target in layout.targets:
        weights = adapter.weights.get((target.layer, target.name)) if adapter is not None else None
        if weights is None:
            values += [torch.zeros(target.in_features, layout.rank, dtype=target.dtype),
                       torch.zeros(layout.rank, target.out_features, dtype=target.dtype)]
        else:
            values += [weights.a, weights.b]
    return values
