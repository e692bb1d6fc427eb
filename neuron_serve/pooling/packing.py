"""Texts into the rows a pooling model compiles: several texts a row, each a segment of its own.

A compiled row of length L holds texts whose lengths add up to at most L (and at most the
graph's segments), placed by first-fit decreasing; its attention mask holds each token's
segment (0 padding, k the row's k-th text), from which the graph builds a block-diagonal
attention, positions restarting per text and one pooled vector per segment (packed_graph.py).
Which L a batch is packed into is chosen by what the compiled calls cost (measured by the
runner at load): each compiled length is tried, a text longer than it going to the smallest
length that holds it, and the cheapest plan is run. One text alone is its own bucket's row, as
unpacked; many short texts fill a few long rows rather than many short ones.

Plain data and arithmetic: no torch-xla, no model. A graph of one segment (packing off) packs
one text a row, which is the padded layout.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch


@dataclass(frozen=True)
class Rows:
    """Texts packed into rows of one compiled length: per row, the indices of the texts it holds, in order."""

    length: int
    rows: tuple[tuple[int, ...], ...]


def first_fit_decreasing(lengths: Sequence[int], members: Sequence[int], capacity: int,
                         most: int) -> list[list[int]]:
    """``members`` (indices into ``lengths``) into rows of ``capacity`` tokens and at most ``most`` texts: the
    longest first, each into the first row with room (a row of its own when none has)."""
    rows: list[list[int]] = []
    free: list[int] = []
    for i in sorted(members, key=lambda i: -lengths[i]):
        n = lengths[i]
        for r, space in enumerate(free):
            if n <= space and len(rows[r]) < most:
                rows[r].append(i)
                free[r] -= n
                break
        else:
            rows.append([i])
            free.append(capacity - n)
    return rows


def plan(lengths: Sequence[int], compiled: Sequence[int], cost: Callable[[int, int], float],
         most: int) -> list[Rows]:
    """The cheapest packing of texts of ``lengths`` tokens into rows of the ``compiled`` lengths (increasing, the
    longest holding every text) holding at most ``most`` texts: for each compiled length L, the texts up to L packed
    into rows of L and each longer one with those of its own smallest bucket; ``cost(bucket index, rows)`` the
    seconds its calls take. With ``most`` 1, each text in its own smallest bucket."""
    best: tuple[float, int, list[Rows]] | None = None
    own = [bisect.bisect_left(compiled, n) for n in lengths]
    known: dict[tuple[int, int], float] = {}

    def steady(bucket: int, rows: int) -> float:
        # The costs are measured, some while the replica serves: a longer row measured cheaper than a shorter one
        # is noise, and would send a short text to a long bucket. A length costs at least what every shorter does.
        if (bucket, rows) not in known:
            known[bucket, rows] = max(cost(b, rows) for b in range(bucket + 1))
        return known[bucket, rows]

    # One text a row (a graph not packed): each text in its own smallest bucket, as padded serving always ran them.
    # Merging short texts into a longer bucket only looks cheaper by the costs measured one call at a time: the
    # groups of separate buckets run on separate cores at once (served, merging: learned buckets 93 requests/s at
    # 16 clients, below the default buckets' 103 in the same run, though they pad less).
    for b in range(len(compiled) if most > 1 else 1):
        groups: dict[int, list[int]] = {}
        for i, home in enumerate(own):
            groups.setdefault(max(b, home), []).append(i)
        packed = [Rows(compiled[g], tuple(tuple(r) for r in first_fit_decreasing(lengths, members, compiled[g],
                                                                                   most)))
                  for g, members in sorted(groups.items())]
        seconds = sum(steady(compiled.index(p.length), len(p.rows)) for p in packed)
        capacity = sum(p.length * len(p.rows) for p in packed)
        if best is None or (seconds, capacity) < best[:2]:
            best = (seconds, capacity, packed)
    return best[2]


def tensors(packed: Rows, ids: Sequence[Sequence[int]], type_ids: Sequence[Sequence[int] | None] | None,
            names: Sequence[str], pad_token_id: int) -> list[torch.Tensor]:
    """One packing's rows as the graph's inputs: token ids (padding ``pad_token_id``), the attention mask holding
    each token's segment (1 for a row's first text, 2 for its second, ..., 0 padding) and token types."""
    count, length = len(packed.rows), packed.length
    tokens = np.full((count, length), pad_token_id, dtype=np.int64)
    segments = np.zeros((count, length), dtype=np.int64)
    types = np.zeros((count, length), dtype=np.int64) if "token_type_ids" in names else None
    for r, row in enumerate(packed.rows):
        at = 0
        for k, i in enumerate(row, start=1):
            n = len(ids[i])
            tokens[r, at:at + n] = ids[i]
            segments[r, at:at + n] = k
            if types is not None and type_ids is not None and type_ids[i] is not None:
                types[r, at:at + n] = type_ids[i]
            at += n
    given = {"input_ids": tokens, "attention_mask": segments, "token_type_ids": types}
    return [torch.from_numpy(given[name]) for name in names]


def padding_shares(packed: Rows, lengths: Sequence[int]) -> dict[int, int]:
    """Each text's share of its row's padding (the row's free tokens split by the texts' lengths, the remainder
    on its first text): what the padding metrics count for it, adding up to the rows' capacity less their tokens."""
    shares: dict[int, int] = {}
    for row in packed.rows:
        used = sum(lengths[i] for i in row)
        free = packed.length - used
        parts = [free * lengths[i] // used for i in row]
        parts[0] += free - sum(parts)
        shares.update(zip(row, parts))
    return shares
