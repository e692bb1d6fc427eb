"""What a replica's compiled calls cost in padding, per family of compiled shapes, and the sizes it was asked for.

A call runs a request's real size (a prompt's tokens, a decode step's rows) padded up to the bucket compiled for
it; the difference is work the core does for nothing. A replica counts both per bucket, as
``neuron_serve_bucket_work_total{family, bucket, kind="real"|"padded"}``, and keeps the sizes it saw
(buckets/traffic.py's Sizes) in the compile cache, under ``traffic/<model>/<replica>.json``: the cache outlives the
replica and is shared by a deployment's replicas (the Helm chart's volume), so ``neuron-serve buckets`` reads
every replica's sizes from there and proposes bucket lists for them (buckets/proposal.py).

The families of a generate model: ``prefill`` (a prompt's tokens computed, against the prefill bucket that ran
them; after a cached prefix, the tokens after it), ``decode_rows`` (the sequences of a decode call, against its
rows bucket), ``decode_context`` (the positions a decode call's longest row attends over, against its context
bucket) and ``chunk`` (a chunked prompt's tokens beside the decode rows, against the chunk bucket). Of a
pooling model: ``length`` (an input's tokens, against the length bucket that ran it). :meth:`Usage.summary` is what
the model's metadata says of it (``parameters.padding``), read from what the replica counted since it started.
"""

from __future__ import annotations

import json
import logging
import os
import re
import tempfile
import threading
from pathlib import Path

from .. import metrics
from . import traffic
from .traffic import Sizes

logger = logging.getLogger("neuron_serve")

# A replica writes its sizes at most this long after it records one (and once more when it stops), so what
# `neuron-serve buckets` reads of a running deployment is its traffic up to a few seconds ago.
SAVE_DELAY_S = 2.0
TRAFFIC_DIR = "traffic"


def traffic_dir(cache_root: str | Path, model: str) -> Path:
    """Where the replicas of ``model`` keep their sizes, under a compile cache's root."""
    return Path(cache_root) / TRAFFIC_DIR / _safe(model)


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name) or "_"


class Usage:
    """One model's recorded sizes on one replica and its padding counters (thread-safe: a replica's engines share
    one, :func:`for_model`)."""

    def __init__(self, model: str, replica: str, cache_root: str | Path | None) -> None:
        self.model, self.replica = model, replica
        self.sizes = Sizes()
        self.root = Path(cache_root) if cache_root is not None else None
        self.path = traffic_dir(cache_root, model) / f"{_safe(replica)}.json" if cache_root is not None else None
        self._counters: dict[tuple[str, int], tuple] = {}
        self._work: dict[tuple[str, int], list[int]] = {}  # (family, bucket) -> [calls, real, padded]
        self._lock = threading.Lock()
        self._timer: threading.Timer | None = None  # the write due for what was recorded since the last one

    def counters(self, family: str, bucket: int) -> tuple:
        """The real and padded counters of ``bucket`` of ``family``."""
        key = (family, bucket)
        found = self._counters.get(key)
        if found is None:
            labels = {"model": self.model, "replica": self.replica, "family": family, "bucket": str(bucket)}
            found = self._counters[key] = (metrics.BUCKET_WORK.labels(**labels, kind="real"),
                                           metrics.BUCKET_WORK.labels(**labels, kind="padded"))
        return found

    def record(self, family: str, size: int, bucket: int, padded: int | None = None) -> tuple:
        """A call of real ``size`` on ``bucket``, padded by ``padded`` (default: to the bucket; a text packed
        beside others: its share of its row's padding): kept; returns its real and padded counters for the caller
        to count (an engine counts on its own thread, with its other metrics)."""
        self.sizes.record(family, size)
        with self._lock:
            work = self._work.setdefault((family, bucket), [0, 0, 0])
            work[0] += 1
            work[1] += size
            work[2] += max(bucket - size, 0) if padded is None else padded
            if self.path is not None and self._timer is None:
                self._timer = threading.Timer(SAVE_DELAY_S, self.save)
                self._timer.daemon = True  # the stop's own write outlives it
                self._timer.start()
        return self.counters(family, bucket)

    def counts(self, family: str) -> dict[int, int]:
        """``family``'s sizes as the deployment saw them: this replica's (kept here, up to now) and the other
        replicas' kept in the compile cache (size -> calls)."""
        merged = self.sizes.of(family)
        if self.root is not None:
            for size, times in recorded(self.root, self.model, but=self.path).of(family).items():
                merged[size] += times
        return dict(merged)

    def summary(self) -> dict[str, dict]:
        """Per family: padded work as a fraction of all the work its calls did, and each bucket's calls, real and
        padded units (what ``parameters.padding`` of the model's metadata says)."""
        with self._lock:
            work = {key: tuple(value) for key, value in self._work.items()}
        return _summary(work)

    def save(self) -> None:
        """Write the sizes out (atomically: a reader never sees half a file); a cache that cannot be written is
        not the replica's failure."""
        if self.path is None:
            return
        with self._lock:
            if self._timer is not None:
                self._timer.cancel()  # this write holds what it would have written
                self._timer = None
            body = {"model": self.model, "replica": self.replica, "sizes": self.sizes.as_dict()}
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".sizes-")
                with os.fdopen(fd, "w") as out:
                    json.dump(body, out)
                os.replace(tmp, self.path)
            except OSError:
                pass


def merged_summaries(summaries: list[dict[str, dict]]) -> dict[str, dict]:
    """:meth:`Usage.summary` of several processes (a replica's tensor-parallel groups) as one."""
    work: dict[tuple[str, int], tuple[int, int, int]] = {}
    for summary in summaries:
        for family, entry in summary.items():
            for bucket, counted in entry["buckets"].items():
                calls, real, padded = work.get((family, int(bucket)), (0, 0, 0))
                work[family, int(bucket)] = (calls + counted["calls"], real + counted["real"],
                                             padded + counted["padded"])
    return _summary(work)


def _summary(work: dict[tuple[str, int], tuple[int, int, int]]) -> dict[str, dict]:
    found: dict[str, dict] = {}
    for (family, bucket), (calls, real, padded) in sorted(work.items()):
        entry = found.setdefault(family, {"padded_fraction": 0.0, "buckets": {}})
        entry["buckets"][str(bucket)] = {"calls": calls, "real": real, "padded": padded}
    for entry in found.values():
        real = sum(b["real"] for b in entry["buckets"].values())
        padded = sum(b["padded"] for b in entry["buckets"].values())
        entry["padded_fraction"] = round(padded / (real + padded), 4) if real + padded else 0.0
    return found


_USAGE: dict[tuple[str, str, Path | None], Usage] = {}
_USAGE_LOCK = threading.Lock()


def for_model(model: str, replica: str) -> Usage:
    """The process's :class:`Usage` of ``model`` on ``replica``, kept in the current compile cache (none: counted
    only)."""
    from ..compile import cache as compile_cache  # noqa: PLC0415 - the cache module imports torch-xla's pieces

    store = compile_cache.current()
    root = store.root if store is not None else None
    with _USAGE_LOCK:
        usage = _USAGE.get((model, replica, root))
        if usage is None:
            usage = _USAGE[(model, replica, root)] = Usage(model, replica, root)
        return usage


def replicas_recorded(cache_root: str | Path, model: str) -> int:
    """How many replicas (of this deployment and the earlier ones on the cache) kept sizes of ``model``."""
    folder = traffic_dir(cache_root, model)
    return len(list(folder.glob("*.json"))) if folder.is_dir() else 0


def recorded(cache_root: str | Path, model: str, but: Path | None = None) -> Sizes:
    """Every replica's sizes of ``model`` kept under ``cache_root`` (all ``but`` one file), merged (an unreadable
    file is skipped)."""
    merged = Sizes()
    folder = traffic_dir(cache_root, model)
    for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        if path == but:
            continue
        try:
            merged = merged.merge([Sizes.from_dict(json.loads(path.read_text())["sizes"])])
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return merged


def recorded_counts(model: str, family: str) -> tuple[dict[int, int], bool]:
    """Every replica's recorded sizes of ``family`` of ``model`` in the current compile cache (size -> calls), and
    whether there is a cache to read."""
    from ..compile import cache as compile_cache  # noqa: PLC0415 - the cache module imports torch-xla's pieces

    store = compile_cache.current()
    return (recorded(store.root, model).of(family) if store is not None else {}), store is not None


def shares(model: str, family: str, buckets: list[int] | tuple[int, ...], what: str) -> tuple[float, ...] | None:
    """Each of ``buckets``' share of the sizes of ``family`` the model's replicas recorded in the compile cache (a
    size counted on the smallest bucket that holds it; one past them all, on the largest): what a background
    compile weights the padding each next model saves by, so the buckets the traffic uses come first. None when
    nothing is recorded. Logged, ``what`` naming the sizes."""
    counts, _ = recorded_counts(model, family)
    if not counts:
        return None
    held = [use["requests"] for use in traffic.per_bucket(counts, buckets).values()]
    total = sum(held)
    logger.info("model %s: compile order for the %d %s recorded (%s)", model, total, what,
                ", ".join(f"{n}: {share / total:.0%}" for n, share in zip(buckets, held)))
    return tuple(share / total for share in held)


def learn(model: str, family: str, what: str, defaults: list[int], wanted: int, unit: str) -> tuple[list[int], int]:
    """A family's ``auto`` buckets as a starting replica picks them: once ``wanted`` calls of it are recorded, as
    many buckets as ``defaults`` (the largest kept) that pad them least, else ``defaults``; logged either way, as
    ``what`` (its model.yaml field) in ``unit``. Returns the buckets and the calls they were learned from (0:
    the defaults)."""
    counts, cached = recorded_counts(model, family)
    calls = sum(counts.values())
    if calls < wanted:
        where = f"{calls} recorded of the {wanted} it waits for" if cached else "the compile cache is off"
        logger.info("model %s: %s %s, the defaults (auto: %s)", model, what, defaults, where)
        return defaults, 0
    chosen = traffic.propose(counts, len(defaults), defaults[-1])
    logger.info("model %s: %s %s, learned from %d recorded %s: padded work %.2fx the real, against %.2fx with the "
                "defaults %s", model, what, chosen, calls, unit, traffic.padding(counts, chosen),
                traffic.padding(counts, defaults), defaults)
    return chosen, calls


def learned_batch_sizes(config):
    """``config`` as a task: infer replica starting now compiles it: with ``batch_sizes: auto``, a copy whose batch
    sizes are :func:`learn`'s from the chunks (family ``rows``) its replicas recorded, the defaults until
    ``learn_buckets_after`` are; any other config as it is."""
    if config.batch_sizes != "auto" or not config.dynamic_batch:
        return config
    from .auto import AUTO_LEARN_AFTER  # noqa: PLC0415

    defaults = config.compiled_batch_sizes()
    chosen, _ = learn(config.name, "rows", "batch sizes", defaults, config.learn_buckets_after or AUTO_LEARN_AFTER,
                      "chunks")
    return config.model_copy(update={"batch_sizes": chosen})


def describe(model: str, summary: dict[str, dict], replicas: int = 1) -> str:
    """:meth:`Usage.summary` (or :func:`merged_summaries`) as a person reads it: per family, the padded share of
    the work, then each bucket's calls, real and padded units (``neuron-serve status --buckets``)."""
    of = f" ({replicas} replicas)" if replicas != 1 else ""
    if not summary:
        return f"{model}{of}: no call counted yet"
    lines = [f"{model}{of}:"]
    for family, entry in summary.items():
        lines.append(f"  {family}: {entry['padded_fraction']:.1%} of the work padded")
        lines.append(f"    {'bucket':>8} {'calls':>9} {'real':>11} {'padded':>11} {'padded %':>9}")
        for bucket, counted in sorted(entry["buckets"].items(), key=lambda item: int(item[0])):
            work = counted["real"] + counted["padded"]
            share = f"{counted['padded'] / work:.1%}" if work else "-"
            lines.append(f"    {bucket:>8} {counted['calls']:>9} {counted['real']:>11} {counted['padded']:>11} "
                         f"{share:>9}")
    return "\n".join(lines)
