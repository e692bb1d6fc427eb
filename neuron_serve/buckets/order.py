"""In which order a model's grid of compiled models (shape buckets x batch sizes) is compiled.

A replica serves as soon as it holds the largest shape bucket at the largest batch size:
any request fits it (a shorter one padded up to the bucket, a batch split and padded into
calls of that size). Every compiled model added after it only saves padding. So the rest
compile in the order that saves the most padding first, greedily: each next one is the
model whose arrival lowers the expected padded work the most, for requests whose rows are
uniform over 1..max_batch_size and whose shape needs each bucket equally often, or as often as the
traffic the model's replicas recorded says (``weights``: each shape bucket's share of the requests).

Work is counted in elements (rows x the bucket's elements per row); a call costs its rows
plus ``CALL_OVERHEAD_ROWS`` (what a call costs beyond its rows, so that 30 rows are not
counted cheaper as 30 calls of one than padded into one call of 32); a batch runs as the
compiled sizes of lowest summed cost (:func:`~.batch_sizes.plan`, as the runtime picks them
by measured cost), on the smallest compiled bucket that holds its shape (as the runtime
chooses). What is saved is that work less the request's own rows.
"""

from __future__ import annotations

import math
from typing import Sequence

from .batch_sizes import plan

# A call's fixed cost in rows: measured on the examples (2 vCPUs, emulated), the MLP's call
# costs about 14 rows' work more than its rows, the encoder's about 2; 4 stands between them.
CALL_OVERHEAD_ROWS = 4

Entry = tuple[int, int]  # (shape bucket index, batch size)


def _elements(size: Sequence[int]) -> int:
    return math.prod(size) if size else 1


def expected_padding(compiled: set[Entry], shapes: Sequence[Sequence[int]], max_rows: int,
                     weights: Sequence[float] | None = None) -> float:
    """The expected fraction of the work spent on padding (and on calls' fixed cost) with
    ``compiled`` models, over rows 1..``max_rows`` and each shape bucket alike, or each by its
    share of ``weights`` (1.0 when some shape asked for has no bucket that holds it)."""
    by_bucket: dict[int, dict[int, float]] = {}
    for bucket, size in compiled:
        by_bucket.setdefault(bucket, {})[size] = size + CALL_OVERHEAD_ROWS
    done = needed = 0.0
    for need in range(len(shapes)):
        weight = 1.0 if weights is None else weights[need]
        if not weight:
            continue
        runs_on = next((b for b in sorted(by_bucket) if b >= need), None)
        if runs_on is None:
            return 1.0
        costs = by_bucket[runs_on]
        for rows in range(1, max_rows + 1):
            done += weight * sum(costs[size] for size in plan(rows, costs)) * _elements(shapes[runs_on])
            needed += weight * rows * _elements(shapes[need])
    return 1.0 - needed / done if done else 0.0


def compile_order(shapes: Sequence[Sequence[int]], batch_sizes: Sequence[int], max_rows: int,
                  first: Sequence[Entry], weights: Sequence[float] | None = None) -> list[Entry]:
    """Every (shape bucket, batch size) of the grid: ``first`` (what the replica needs to be
    ready), then each next the one that saves the most padding on requests spread as ``weights``
    says (ties: the smaller model, quicker to compile)."""
    grid = [(bucket, size) for bucket in range(len(shapes)) for size in sorted(batch_sizes)]
    order = list(first)
    compiled = set(order)
    rest = [e for e in grid if e not in compiled]
    while rest:
        best = min(rest, key=lambda e: (expected_padding(compiled | {e}, shapes, max_rows, weights),
                                        _elements(shapes[e[0]]) * e[1], e))
        order.append(best)
        compiled.add(best)
        rest.remove(best)
    return order
