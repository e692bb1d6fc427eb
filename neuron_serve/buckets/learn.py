"""A serving replica that changes one family of its compiled sizes for those its traffic pads least.

A replica with ``auto`` sizes (a pooling model's ``pooling.length_buckets``, a task: infer model's ``batch_sizes``,
a generate model's ``generation.prefill_buckets`` or ``decode_batch_buckets``) starts on those learned from what the
model's replicas recorded (or the defaults), and keeps looking while it serves: each time it has recorded another
``every`` calls of the family, it proposes the sizes that pad everything recorded so far least (this replica's and
the others', kept in the compile cache; as many as it serves, the largest kept: the compiled-model budget does not
grow and every request still fits). When the proposal cuts the work of what was recorded by at least ``MIN_SAVING``,
it compiles the models it does not have on the compile queue, behind any other compile (BACKGROUND), while the old
ones serve; once all are compiled it switches to them in one step (a grid's ModelRunner.grow, a generate model's
GenerationBuild.switch) and the old ones no longer held are dropped. A request already formed for the old sizes runs
on the new ones (padded further, or split): answers are the same whichever compiled model runs them. A compile that
fails abandons the switch (logged, counted): the old sizes serve on, and that list is not tried again by this
replica.

What a person reads: a log line per decision, ``neuron_serve_bucket_switches_total{family, outcome}``, and the
model's metadata (``parameters.rebucketing``). Each kind's variant says what its sizes are and how it compiles and
serves others: a grid's (assembly/rebucket.py: a task: infer model's batch sizes; pooling/rebucket.py: a pooling
model's length buckets), a generate model's buckets (generation/compiling/rebucket.py). :func:`attach` puts them on a replica
of any kind.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, Mapping

from .. import metrics
from . import traffic
from .auto import AUTO_LEARN_AFTER

logger = logging.getLogger("neuron_serve")

MIN_SAVING = 0.05  # the least share of the recorded calls' work a switch must save to be worth its compiles


class Rebucketing:
    """When and to what one replica changes a family of its sizes (see the module's docstring). A variant says
    which: ``family`` (buckets/usage's), ``what`` and ``unit`` (as its log lines name them) and the hooks below."""

    family = ""
    what = ""  # "length buckets", "batch sizes"
    unit = ""  # "inputs", "chunks"

    def __init__(self, name: str, replica: str, usage: Any, every: int, ready: Callable[[], bool]) -> None:
        self.name = name  # the model's
        self.usage = usage  # buckets/usage.Usage: what this replica recorded, and the others' in the cache
        self.every = every
        self.ready = ready  # whether the replica's own compile has ended (a switch never runs beside it)
        self.switches = 0
        self.state = "serving"  # or "compiling [sizes]"
        self.abandoned: set[tuple[int, ...]] = set()  # lists whose compile failed: the replica does not retry them
        self._next = every  # this replica's recorded calls at the next look
        self._busy = threading.Lock()
        self.thread: threading.Thread | None = None
        labels = {"model": name, "replica": replica, "family": self.family}
        self._switched = metrics.BUCKET_SWITCHES.labels(**labels, outcome="switched")
        self._abandoned = metrics.BUCKET_SWITCHES.labels(**labels, outcome="abandoned")

    # -- what a variant says ---------------------------------------------------------------

    def current(self) -> list[int]:
        """The sizes served now, smallest first."""
        raise NotImplementedError

    # -- the decisions ---------------------------------------------------------------------

    def describe(self) -> dict:
        """What the model's metadata says of it (``parameters.rebucketing``)."""
        return {"every": self.every, "switches": self.switches, "state": self.state}

    def observe(self) -> None:
        """Called on the event loop after calls are recorded: cheap unless a look is due."""
        recorded = self.usage.sizes.total(self.family)
        if recorded < self._next or not self.ready() or self._busy.locked():
            return
        self._next = recorded + self.every
        self.thread = threading.Thread(target=self.look, name=f"rebucket-{self.name}", daemon=True)
        self.thread.start()

    def look(self) -> bool:
        """Propose sizes for the calls recorded, and switch to them when they save enough; whether it switched."""
        if not self._busy.acquire(blocking=False):
            return False
        try:
            current = self.current()
            counts = self.usage.counts(self.family)
            proposed = traffic.propose(counts, len(current), current[-1])
            now, then = traffic.padding(counts, current), traffic.padding(counts, proposed)
            calls = sum(counts.values())
            name = self.name
            if proposed == current or then > now * (1 - MIN_SAVING):
                logger.info("model %s: %s %s kept for the %d %s recorded: padded work %.2fx the real, %.2fx with "
                            "the best %d (%s)", name, self.what, current, calls, self.unit, now, then, len(current),
                            proposed)
                return False
            if tuple(proposed) in self.abandoned:  # its compile failed once: not tried again at every look
                logger.debug("model %s: %s %s kept: %s was abandoned before", name, self.what, current, proposed)
                return False
            logger.info("model %s: switching %s %s -> %s for the %d %s recorded: padded work %.2fx the real -> "
                        "%.2fx; compiling the new ones while the old serve", name, self.what, current, proposed,
                        calls, self.unit, now, then)
            return self._switch(proposed, f"traffic ({calls} {self.unit}, while serving)", now, then)
        finally:
            self._busy.release()

    def _switch(self, sizes: list[int], source: str, now: float, then: float) -> bool:
        started = time.perf_counter()
        self.state = f"compiling {sizes}"
        try:
            compiled, kept = self.rebuild(sizes, source)
        except Abandoned as exc:
            self.state = "serving"
            self.abandoned.add(tuple(sizes))
            self._abandoned.inc()
            logger.warning("model %s: %s %s abandoned (%s did not end: %s); %s serve on", self.name,
                           self.what, sizes, exc.label, exc.reason, self.current())
            return False
        self.switches += 1
        self.state = "serving"
        self._switched.inc()
        logger.info("model %s: now on %s %s (%d compiled in %.1f s, %d kept); padded work %.2fx -> %.2fx for the "
                    "%s recorded", self.name, self.what, sizes, compiled, time.perf_counter() - started, kept,
                    now, then, self.unit)
        return True

    def rebuild(self, sizes: list[int], source: str) -> tuple[int, int]:
        """Compile what ``sizes`` need and the replica does not hold, then serve them: (models compiled, models
        kept). Raises :class:`Abandoned` when a compile or the load fails (the old sizes still serve)."""
        raise NotImplementedError


class Abandoned(Exception):
    """A switch's compile or load did not end: ``label`` names the job, ``reason`` what it raised."""

    def __init__(self, job: Any) -> None:
        self.label = job.label
        self.reason = job.future.exception() if job.future.done() and not job.future.cancelled() else "cancelled"
        super().__init__(f"{self.label}: {self.reason}")


def attach(replica: Any, settings: Any, build: Any,
           families: Mapping[str, Callable[[int], Rebucketing]]) -> list[Rebucketing]:
    """Re-bucketing on a replica of any kind: a variant for each of ``families`` (a field of ``settings``, a
    model.yaml section, that may be ``auto`` -> the variant for it, given how many recorded calls apart it looks)
    that ``settings`` leaves to the traffic, looking every ``settings.learn_buckets_after`` calls (default:
    AUTO_LEARN_AFTER). None without ``settings`` or a ``build`` (an artifact's models compile nowhere).

    ``replica`` is a plane, whose ``rebucket`` is then its one family's (None without), or an engine group's engines,
    which each observe all of them (``rebucketings``). Returns them."""
    found: list[Rebucketing] = []
    if settings is not None and build is not None:
        every = settings.learn_buckets_after or AUTO_LEARN_AFTER
        found = [variant(every) for field, variant in families.items() if getattr(settings, field) == "auto"]
    if isinstance(replica, (list, tuple)):
        for engine in replica:
            engine.rebucketings = found
    else:
        replica.rebucket = found[0] if found else None
    return found
