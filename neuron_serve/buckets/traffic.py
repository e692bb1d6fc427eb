"""Buckets from the traffic a model gets: the sizes it was asked for, the padding its buckets cost, better lists.

A compiled shape is a guess made before the first request; padding a request up to the bucket that runs it is
work the core does for nothing. :class:`Sizes` keeps what a replica saw of one family of compiled shapes (a
pooling model's token lengths, a generate model's prompt lengths, an infer model's rows): how many requests
came at each size. :func:`padding` is the work its buckets spend on them against the work they needed, and
:func:`propose` the bucket list of at most ``count`` sizes that spends the least on them (the largest bucket kept,
so every request still fits): the padded work a bucket list costs is separable by bucket, so the best list is a
dynamic programme over the sizes seen, sorted (each boundary of an optimal list is a size some request had).

Work is counted as :mod:`.order` counts it: a call of ``n`` units costs ``n`` plus ``overhead`` (what a call costs
beyond its units; in tokens for lengths, in rows for batch sizes), so a list of one bucket a size is not counted
free. Arithmetic only: no model, no torch.
"""

from __future__ import annotations

import bisect
import json
import threading
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Mapping, Sequence

import numpy as np


def bucket_of(size: int, buckets: Sequence[int]) -> int | None:
    """The smallest of ``buckets`` (sorted) that holds ``size``; None when none does."""
    index = bisect.bisect_left(buckets, size)
    return buckets[index] if index < len(buckets) else None


def padding(counts: Mapping[int, int], buckets: Sequence[int], overhead: float = 0.0) -> float:
    """The padded work over the real work of requests ``counts`` (size -> how many) run on ``buckets``: 1.0 is
    none padded; a size no bucket holds counts as run on the largest (it would be refused or split)."""
    buckets = sorted(buckets)
    real = done = 0.0
    for size, times in counts.items():
        runs_on = bucket_of(size, buckets) or buckets[-1]
        real += times * (size + overhead)
        done += times * (runs_on + overhead)
    return done / real if real else 1.0


def per_bucket(counts: Mapping[int, int], buckets: Sequence[int]) -> dict[int, dict[str, float]]:
    """Each bucket's requests, real units and padded units (what a person reads: where the padding is)."""
    buckets = sorted(buckets)
    found = {b: {"requests": 0, "real": 0, "padded": 0} for b in buckets}
    for size, times in counts.items():
        runs_on = bucket_of(size, buckets) or buckets[-1]
        entry = found[runs_on]
        entry["requests"] += times
        entry["real"] += times * size
        entry["padded"] += times * (runs_on - min(size, runs_on))
    return found


def propose(counts: Mapping[int, int], count: int, largest: int, overhead: float = 0.0,
            smallest: int = 1) -> list[int]:
    """At most ``count`` bucket sizes, ``largest`` among them, that run ``counts`` (size -> requests) with the least
    padded work (every size at least ``smallest``, a compiled shape's floor). Sizes past ``largest`` count as
    ``largest`` (they run there today too)."""
    if count < 1:
        raise ValueError("a bucket list needs at least one bucket")
    sizes = sorted({max(smallest, min(size, largest)) for size in counts} | {largest})
    weight = Counter()
    for size, times in counts.items():
        weight[max(smallest, min(size, largest))] += times
    n = len(sizes)
    counts_sorted = np.array([weight[size] for size in sizes], dtype=np.float64)
    prefix = np.concatenate([[0.0], np.cumsum(counts_sorted)])  # requests among sizes[:i]
    width = np.array(sizes, dtype=np.float64) + overhead  # a call's work on each candidate bucket
    # best[k, j]: least work of the requests up to sizes[j] with k + 1 buckets, the last one sizes[j]; a range
    # sizes[i + 1..j] run on bucket sizes[j] costs its requests times width[j].
    best = np.full((count, n), np.inf)
    choice = np.full((count, n), -1, dtype=np.int64)
    best[0] = prefix[1:] * width
    for k in range(1, count):
        for j in range(1, n):
            options = best[k - 1, :j] + (prefix[j + 1] - prefix[1:j + 1]) * width[j]
            i = int(np.argmin(options))
            best[k, j], choice[k, j] = options[i], i
    k = min(range(count), key=lambda k: (best[k, n - 1], k))
    chosen, j = [], n - 1
    while j >= 0 and k >= 0:
        chosen.append(sizes[j])
        j, k = int(choice[k, j]), k - 1
    return sorted(chosen)


@dataclass
class Sizes:
    """How many requests came at each size, for each family of one model (thread-safe, bounded: the oldest
    ``limit`` halved away when more sizes than that were recorded, so a change of traffic shows)."""

    limit: int = 100_000
    counts: dict[str, Counter] = field(default_factory=dict)
    _totals: Counter = field(default_factory=Counter, repr=False)  # each family's sum, kept: record runs per call
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def record(self, family: str, size: int, times: int = 1) -> None:
        with self._lock:
            counter = self.counts.setdefault(family, Counter())
            counter[int(size)] += times
            self._totals[family] += times
            if self._totals[family] > self.limit:
                for key in list(counter):
                    counter[key] //= 2
                    if not counter[key]:
                        del counter[key]
                self._totals[family] = sum(counter.values())

    def of(self, family: str) -> Counter:
        with self._lock:
            return Counter(self.counts.get(family, {}))

    def total(self, family: str) -> int:
        with self._lock:
            return self._totals[family]

    def as_dict(self) -> dict[str, dict[str, int]]:
        """JSON-ready: family -> {size: requests}."""
        with self._lock:
            return {family: {str(size): n for size, n in sorted(counter.items())}
                    for family, counter in self.counts.items()}

    @classmethod
    def from_dict(cls, data: Mapping[str, Mapping[str, int]]) -> "Sizes":
        sizes = cls()
        for family, counter in data.items():
            for size, n in counter.items():
                sizes.record(family, int(size), int(n))
        return sizes

    def merge(self, others: Iterable["Sizes"]) -> "Sizes":
        """These sizes and ``others``' together (a deployment's replicas)."""
        merged = Sizes.from_dict(self.as_dict())
        for other in others:
            for family, counter in other.as_dict().items():
                for size, n in counter.items():
                    merged.record(family, int(size), int(n))
        return merged

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.as_dict(), indent=1) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> "Sizes":
        return cls.from_dict(json.loads(Path(path).read_text()))
