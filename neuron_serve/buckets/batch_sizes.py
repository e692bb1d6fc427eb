"""Compiled batch sizes: which to compile, and which cover a batch of rows at the lowest cost.

A model compiled for one batch size costs that many rows of compute whether one row or
all of them arrive. With a set of compiled sizes, a batch of ``n`` rows runs as the
multiset of sizes whose summed cost is lowest; costs are measured per size on the
machine (the runner times each size when it loads), so whether 19 rows run as 16 + 4
or as 32 is decided by this core's timings, not by a fixed rule.
"""

from __future__ import annotations

import functools
from typing import Mapping, Sequence

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def default_batch_sizes(max_batch_size: int) -> list[int]:
    """Powers of 4 below ``max_batch_size``, plus ``max_batch_size`` itself.

    A factor of 4 between sizes bounds the padding of a batch that falls between two
    sizes at 3/4 of the smaller chunk while keeping the compiled set small (4 sizes for
    the default max of 32), so start-up compiles and loads few executables.
    """
    sizes, size = [], 1
    while size < max_batch_size:
        sizes.append(size)
        size *= 4
    return sizes + [max_batch_size]


def check_batch_sizes(sizes: Sequence[int], *, field: str = "batch_sizes", limit: int | None = None) -> list[int]:
    """``sizes`` sorted and deduplicated; refuses non-positive sizes, sizes above ``limit`` or none."""
    sizes = list(sizes)
    if not sizes:
        raise ValueError(f"{field}: give at least one batch size")
    bad = [s for s in sizes if isinstance(s, bool) or not isinstance(s, int) or s < 1]
    if bad:
        raise ValueError(f"{field}: batch sizes must be positive integers, got {bad}")
    if limit is not None and max(sizes) > limit:
        raise ValueError(f"{field}: {max(sizes)} is larger than batching.max_batch_size ({limit}); a batch never "
                         f"holds more rows than that, so the size would never run. Lower it or raise the maximum.")
    return sorted(set(sizes))


def monotone(costs: Mapping[int, float]) -> dict[int, float]:
    """``costs`` with each size costing at least what every smaller size costs.

    A larger compiled size does at least the work of a smaller one, so a measured
    inversion is noise. The runner times every size in turn, each call finding the
    others' weights in the cache, and a memory-bound model's smaller sizes can come out
    a little slower than the next one up; taken at face value, a lone row would then be
    padded to the larger size and, served steadily, cost more than it would alone
    (measured on the MLP example: 1 row 1.3 ms, padded to 4 rows 2.1 ms).
    """
    result, floor = {}, 0.0
    for size in sorted(costs):
        floor = max(floor, costs[size])
        result[size] = floor
    return result


def plan(rows: int, costs: Mapping[int, float]) -> list[int]:
    """The compiled sizes, largest first, whose summed ``costs`` is lowest while covering ``rows``.

    A dynamic program over rows: cover(r) = min over sizes s of cost[s] + cover(r - s),
    where a size larger than the rows left pads them. Ties go to fewer padded rows,
    then fewer calls. Only the last (smallest) chunk of the plan is padded.
    """
    if rows < 1:
        raise ValueError(f"plan: need at least one row, got {rows}")
    if not costs:
        raise ValueError("plan: no compiled sizes")
    sizes = sorted(costs)

    @functools.lru_cache(maxsize=None)
    def cover(r: int) -> tuple[float, int, int, tuple[int, ...]]:
        if r <= 0:
            return 0.0, -r, 0, ()
        best = None
        for s in sizes:
            cost, padded, calls, chosen = cover(r - s)
            option = (costs[s] + cost, padded, calls + 1, (s, *chosen))
            if best is None or option[:3] < best[:3]:
                best = option
        return best

    chosen = cover(rows)[3]
    cover.cache_clear()
    return sorted(chosen, reverse=True)


def split(flat: list, rows: int, chunk_sizes: Sequence[int]) -> list[tuple[int, list, int]]:
    """Per planned chunk: (its compiled size, the flat inputs sliced to it and padded, padded rows)."""
    import torch  # noqa: PLC0415 - the choice of sizes above is arithmetic, read where no tensor is (model.yaml's checks)

    from . import dynamic_batch  # noqa: PLC0415

    chunks, start = [], 0
    for size in chunk_sizes:
        take = max(0, min(size, rows - start))
        sliced = [dynamic_batch.pad_rows(v[start:start + take], size) if isinstance(v, torch.Tensor) else v for v in flat]
        chunks.append((size, sliced, size - take))
        start += take
    return chunks


def resize_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    """An example input cut or grown (repeating its last row) to ``rows`` along dim 0."""
    from . import dynamic_batch  # noqa: PLC0415

    return t[:rows] if t.shape[0] >= rows else dynamic_batch.pad_rows(t, rows)
