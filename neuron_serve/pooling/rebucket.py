"""A serving pooling replica that changes its own length buckets for those its traffic pads least.

With ``pooling.length_buckets: auto`` a replica starts on the buckets learned from the lengths the model's
replicas recorded (or the defaults), and keeps looking while it serves: each time it has recorded another
``learn_buckets_after`` inputs, it proposes the buckets that pad the lengths seen so far least (this replica's and
the others', kept in the compile cache; as many buckets as it serves, the longest kept: the compiled-model budget
does not grow). When the proposal cuts the work of those inputs by at least ``MIN_SAVING``, it compiles the buckets
it does not have on the compile queue, behind any other compile (BACKGROUND), while the old buckets serve; once all
are compiled it switches to them in one assignment (ModelRunner.grow) and the old buckets no longer held are
dropped. A request padded for the old buckets as the switch lands runs on the new bucket that holds it, padded
further: answers are the same whichever bucket runs them. A compile that fails abandons the switch (logged,
counted): the old buckets serve on.

What a person reads: a log line per decision, ``neuron_serve_bucket_switches_total{outcome}``, and the model's
metadata (``parameters.length_buckets``, ``length_buckets_from``, ``rebucketing``).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from pathlib import Path
from typing import Any, Callable

from .. import metrics
from ..assembly.grid import GridBuild
from ..assembly.queue import BACKGROUND, COMPILED, compile_queue
from ..buckets import traffic
from ..compile.subgraph import compile_count
from ..config.schema import ModelConfig
from ..model import CompiledModel
from .build import grid_source
from .spec import PoolingSpec

logger = logging.getLogger("neuron_serve")

MIN_SAVING = 0.05  # the least share of the recorded inputs' work a switch must save to be worth its compiles


class Rebucketing:
    """When and to what one pooling plane changes its length buckets (see the module's docstring). ``plane`` is
    the replica's serve/pooling/plane.PoolingPlane: its spec, usage, data plane and ``switch``."""

    def __init__(self, plane: Any, config: ModelConfig, base_dir: str | Path | None, module: Any,
                 every: int, ready: Callable[[], bool]) -> None:
        self.plane = plane
        self.config = config
        self.base_dir = base_dir
        self.module = module  # the pooling graph the replica's buckets were compiled from
        self.every = every
        self.ready = ready  # whether the replica's own compile has ended (a switch never runs beside it)
        self.switches = 0
        self.state = "serving"  # or "compiling [buckets]"
        self._next = every  # this replica's recorded inputs at the next look
        self._busy = threading.Lock()
        self.thread: threading.Thread | None = None
        labels = {"model": config.name, "replica": plane.data.replica, "family": "length"}
        self._switched = metrics.BUCKET_SWITCHES.labels(**labels, outcome="switched")
        self._abandoned = metrics.BUCKET_SWITCHES.labels(**labels, outcome="abandoned")

    def describe(self) -> dict:
        """What the model's metadata says of it (``parameters.rebucketing``)."""
        return {"every": self.every, "switches": self.switches, "state": self.state}

    def observe(self) -> None:
        """Called on the event loop after each request's lengths are recorded: cheap unless a look is due."""
        if self.plane.usage.sizes.total("length") < self._next or not self.ready() or self._busy.locked():
            return
        self._next = self.plane.usage.sizes.total("length") + self.every
        self.thread = threading.Thread(target=self.look, name=f"rebucket-{self.config.name}", daemon=True)
        self.thread.start()

    def look(self) -> bool:
        """Propose buckets for the lengths recorded, and switch to them when they save enough; whether it switched."""
        if not self._busy.acquire(blocking=False):
            return False
        try:
            current = list(self.plane.spec.length_buckets)
            counts = self.plane.usage.counts("length")
            proposed = traffic.propose(counts, len(current), current[-1])
            now, then = traffic.padding(counts, current), traffic.padding(counts, proposed)
            inputs = sum(counts.values())
            if proposed == current or then > now * (1 - MIN_SAVING):
                logger.info("model %s: length buckets %s kept for the %d inputs recorded: padded work %.2fx the "
                            "real, %.2fx with the best %d (%s)", self.config.name, current, inputs, now, then,
                            len(current), proposed)
                return False
            logger.info("model %s: switching length buckets %s -> %s for the %d inputs recorded: padded work %.2fx "
                        "the real -> %.2fx; compiling the new ones while the old serve", self.config.name, current,
                        proposed, inputs, now, then)
            return self._switch(proposed, f"traffic ({inputs} inputs, while serving)", now, then)
        finally:
            self._busy.release()

    def _switch(self, lengths: list[int], source: str, now: float, then: float) -> bool:
        started, compiles = time.perf_counter(), compile_count()
        self.state = f"compiling {lengths}"
        spec: PoolingSpec = dataclasses.replace(self.plane.spec, length_buckets=tuple(lengths), buckets_from=source)
        grid = GridBuild(self.config, self.base_dir, source=grid_source(self.module, spec, self.config,
                                                                         self.base_dir))
        served = _served(self.plane.data.runner.model)
        group = compile_queue().group(f"{self.config.name} rebucket {self.switches + 1}")
        jobs = []
        for entry in grid.order:
            held = served.get((lengths[entry.bucket], entry.batch))
            if held is not None:
                grid.adopt(entry, held)
            else:
                jobs.append(group.submit(grid.label(entry), lambda e=entry: grid.compile(e), priority=BACKGROUND))
        group.wait(jobs)
        failed = [j for j in jobs if j.state != COMPILED]
        if failed:
            return self._abandon(lengths, failed[0])
        model = grid.model()
        served_model = self.plane.data.runner.model
        model.input_names, model.output_names = list(served_model.input_names), list(served_model.output_names)
        model.build_info = dataclasses.replace(served_model.build_info,
                                               compiles=served_model.build_info.compiles + compile_count() - compiles)
        # Loading onto the cores compiles: on the queue's thread, as every compiled model joins a replica.
        loading = group.submit(f"load {self.config.name} length buckets {lengths}",
                               lambda: self.plane.switch(model, spec), priority=BACKGROUND, kind="load")
        group.wait([loading])
        if loading.state != COMPILED:
            return self._abandon(lengths, loading)
        self.switches += 1
        self.state = "serving"
        self._switched.inc()
        logger.info("model %s: now on length buckets %s (%d compiled in %.1f s, %d kept); padded work %.2fx -> "
                    "%.2fx for the inputs recorded", self.config.name, lengths, len(jobs),
                    time.perf_counter() - started, len(grid.order) - len(jobs), now, then)
        return True

    def _abandon(self, lengths: list[int], job: Any) -> bool:
        self.state = "serving"
        self._abandoned.inc()
        reason = job.future.exception() if job.future.done() and not job.future.cancelled() else "cancelled"
        logger.warning("model %s: length buckets %s abandoned (%s did not end: %s); %s serve on", self.config.name,
                       lengths, job.label, reason, list(self.plane.spec.length_buckets))
        return False


def _served(model: CompiledModel) -> dict[tuple[int, int], Any]:
    """The compiled models a replica serves, by (length, batch size)."""
    return {(model.spec.sizes[i][0], bucket.batch_size): bucket
            for i in range(len(model.buckets)) for bucket in model.grid(i)}
