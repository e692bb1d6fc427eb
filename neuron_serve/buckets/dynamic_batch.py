"""dynamic_batch: any batch size, split and padded along dim 0 into trace-size chunks.

As in torch-neuronx, inputs are split along dim 0 into chunks of the trace-time batch
size, the last chunk is padded, chunks run through the compiled model, and outputs are
concatenated and unpadded. Partitioned models are chunked as a whole (each chunk runs
every partition), so dynamic batching works for any partition scheme whose inputs and
outputs all carry the batch in dim 0; anything else is refused when it is enabled.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
import torch.utils._pytree as pytree

from ..errors import ConfigError, InvalidInput


def trace_batch_size(shapes: Sequence[torch.Size | None], what: str = "input") -> int:
    """The common dim 0 of the traced tensors; refuses what cannot be chunked."""
    batches = {}
    for i, shape in enumerate(shapes):
        if shape is None:
            continue
        if len(shape) == 0:
            raise ConfigError(f"dynamic_batch: {what} {i} is a scalar; every {what} needs a batch dimension 0.")
        batches[i] = shape[0]
    if len(set(batches.values())) > 1:
        detail = ", ".join(f"{what} {i} has dim 0 = {b}" for i, b in batches.items())
        raise ConfigError(f"dynamic_batch needs the same dim 0 on every {what}; {detail}.")
    if not batches:
        raise ConfigError(f"dynamic_batch: the model has no tensor {what}s to batch.")
    return next(iter(batches.values()))


def check_batch(flat: list[Any], traced_shapes: Sequence[torch.Size | None]) -> int:
    """The batch size of a call, after checking every non-0 dim against trace time."""
    batch = None
    for i, (value, traced) in enumerate(zip(flat, traced_shapes)):
        if traced is None or not isinstance(value, torch.Tensor):
            continue
        if value.dim() != len(traced) or value.shape[1:] != traced[1:]:
            raise InvalidInput(
                f"input {i} has shape {tuple(value.shape)}; with dynamic batching only dim 0 may differ "
                f"from the trace-time shape {tuple(traced)}."
            )
        if batch is not None and value.shape[0] != batch:
            raise InvalidInput(
                f"input {i} has dim 0 = {value.shape[0]} but an earlier input has {batch}; "
                f"all inputs must share the batch size."
            )
        batch = value.shape[0]
    if batch is None or batch < 1:
        raise InvalidInput(f"dynamic batching needs a batch of at least 1 row, got {batch}.")
    return batch


def pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    """``t`` grown to ``rows`` along dim 0 by repeating its last row (keeps values in range)."""
    if t.shape[0] == rows:
        return t
    return torch.cat([t, t[-1:].expand(rows - t.shape[0], *t.shape[1:])])


def split_chunks(flat: list[Any], batch: int, chunk: int) -> list[list[Any]]:
    """Per chunk, the flat inputs sliced to ``chunk`` rows, the last one padded."""
    chunks = []
    for start in range(0, batch, chunk):
        rows = min(chunk, batch - start)
        chunks.append(
            [pad_rows(v[start : start + rows], chunk) if isinstance(v, torch.Tensor) else v for v in flat]
        )
    return chunks


def join_chunks(outputs: list[Any], batch: int) -> Any:
    """Concatenate per-chunk outputs (same structure) along dim 0 and drop the padding."""
    leaves = [pytree.tree_flatten(o) for o in outputs]
    spec = leaves[0][1]
    if len(leaves) == 1:  # one chunk: cut its padding off, no copy
        return pytree.tree_unflatten([t[:batch] for t in leaves[0][0]], spec)
    joined = [torch.cat(parts)[:batch] for parts in zip(*(flat for flat, _ in leaves))]
    return pytree.tree_unflatten(joined, spec)


def run_dynamic(
    run_chunk: Callable[[list[Any]], Any],
    flat: list[Any],
    traced_shapes: Sequence[torch.Size | None],
    chunk: int,
) -> Any:
    """Run ``flat`` of any batch size as ceil(batch / chunk) calls of ``run_chunk``, one after another."""
    batch = check_batch(flat, traced_shapes)
    chunks = split_chunks(flat, batch, chunk)
    return join_chunks([run_chunk(c) for c in chunks], batch)


def enable(traced: Any) -> Any:
    """Turn on dynamic batching for one bucket of a compiled model, in place (see :func:`dynamic_batch`)."""
    inputs = [shape for shape, _ in traced.input_shapes]
    batch = trace_batch_size(inputs, "input")
    for i, shape in enumerate(traced.output_shapes):
        if shape is not None and (len(shape) == 0 or shape[0] != batch):
            raise ConfigError(
                f"dynamic_batch: output {i} has shape {tuple(shape)}, whose dim 0 is not the batch size {batch}; "
                f"only models whose outputs all carry the batch in dim 0 can be chunked."
            )
    traced.batch_size = batch
    traced.dynamic_batch_enabled = True
    return traced
