"""Collate requests into one batch along dim 0, and split batch outputs back per request.

Plain functions, so the batching arithmetic is tested without a server (as LitServe's
``collate_requests``). Padding repeats the last real row, as ``dynamic_batch`` does, so
padded rows never feed out-of-range values (token ids, indices) to the model.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.utils._pytree as pytree

from ..buckets.dynamic_batch import pad_rows
from ..errors import InvalidInput


def _request_rows(r: int, request: list[torch.Tensor], n_inputs: int) -> int:
    """The row count of request ``r``, after checking its inputs agree on dim 0."""
    if len(request) != n_inputs:
        raise InvalidInput(
            f"request {r} has {len(request)} inputs but request 0 has {n_inputs}; "
            f"every request must send the same inputs."
        )
    rows = None
    for i, t in enumerate(request):
        if not isinstance(t, torch.Tensor) or t.dim() == 0:
            what = "a scalar tensor" if isinstance(t, torch.Tensor) else type(t).__name__
            raise InvalidInput(f"input {i} of request {r} is {what}; every input needs a batch dimension 0.")
        if rows is not None and t.shape[0] != rows:
            raise InvalidInput(
                f"input {i} of request {r} has dim 0 = {t.shape[0]} but input 0 has {rows}; "
                f"all inputs of a request must share the row count."
            )
        rows = t.shape[0]
    if not rows:
        raise InvalidInput(f"request {r} has 0 rows; each request needs at least one row.")
    return rows


def collate(requests: list[list[torch.Tensor]], pad_to: int | None = None) -> tuple[list[torch.Tensor], list[int]]:
    """Concatenate each input across requests along dim 0, optionally padded to ``pad_to`` rows.

    Returns the batched inputs and the row count of every request (for :func:`split`).
    Raises ``InvalidInput`` naming the input index when requests disagree on the number of
    inputs, on dim 0 within a request, or on any non-0 dim or dtype across requests.
    """
    if not requests or not requests[0]:
        raise InvalidInput("collate needs at least one request with at least one input tensor.")
    n_inputs = len(requests[0])
    sizes = [_request_rows(r, req, n_inputs) for r, req in enumerate(requests)]
    total = sum(sizes)
    if pad_to is not None and pad_to < total:
        raise ValueError(f"pad_to={pad_to} is smaller than the {total} rows of the batch.")
    batched = []
    for i in range(n_inputs):
        first = requests[0][i]
        for r, req in enumerate(requests[1:], start=1):
            t = req[i]
            if t.shape[1:] != first.shape[1:] or t.dtype != first.dtype:
                raise InvalidInput(
                    f"input {i} of request {r} has shape {tuple(t.shape)} and dtype {t.dtype} but request 0 has "
                    f"{tuple(first.shape)} and {first.dtype}; only dim 0 may differ between requests."
                )
        joined = torch.cat([req[i] for req in requests])
        batched.append(pad_rows(joined, pad_to) if pad_to is not None else joined)
    return batched, sizes


def split(outputs: Any, sizes: list[int]) -> list[Any]:
    """One pytree per request with that request's rows of every tensor leaf; padding is dropped.

    ``outputs`` is any pytree (tensor, tuple, list, dict) whose tensor leaves carry the batch
    in dim 0. Non-tensor leaves (None, numbers) are shared by every request unchanged.
    """
    leaves, spec = pytree.tree_flatten(outputs)
    total = sum(sizes)
    per_leaf: list[Any] = []
    for j, leaf in enumerate(leaves):
        if not isinstance(leaf, torch.Tensor):
            per_leaf.append([leaf] * len(sizes))
            continue
        if leaf.dim() == 0 or leaf.shape[0] < total:
            raise ValueError(
                f"output leaf {j} has shape {tuple(leaf.shape)}; splitting needs dim 0 >= {total}, "
                f"the rows of the batch."
            )
        per_leaf.append(leaf[:total].split(sizes))
    return [pytree.tree_unflatten([parts[k] for parts in per_leaf], spec) for k in range(len(sizes))]

