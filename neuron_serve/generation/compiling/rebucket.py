"""A serving generate replica that changes its prefill or decode-rows buckets for those its traffic pads least.

With ``generation.prefill_buckets: auto`` (or ``decode_batch_buckets: auto``) a replica starts on the buckets
learned from what the model's replicas recorded (build.learned), and keeps looking while it serves
(buckets/learn.py: when it looks and what it proposes). A switch compiles the models the new list needs (for
prefill, a model per new prompt length, and its extends with prefix caching; for decode rows, every decode, mixed
and verify model of a new row count) on the compile queue behind any other compile, each joining the engines as it
is compiled, then drops the ones no longer planned from every engine in one step (compiling.GenerationBuild.switch):
the number of compiled models and the KV cache are the same after as before. A call always runs on a compiled
model that holds it, so answers are the same tokens whichever bucket runs them.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

from ...buckets.learn import Rebucketing
from ...buckets.generation import LEARNED


class BucketRebucketing(Rebucketing):
    """One auto list (``learned``: LEARNED's entry for ``prefill_buckets`` or ``decode_batch_buckets``) of a generate
    model whose models ``build`` (compiling.GenerationBuild) compiles; ``usage`` is what its engines record."""

    unit = "calls"

    def __init__(self, build: Any, name: str, replica: str, usage: Any, learned: tuple[str, str, str],
                 every: int) -> None:
        self.family, field, self.attribute = learned  # one of LEARNED
        self.what = f"generation.{field}"
        super().__init__(name, replica, usage, every, build.finished.is_set)
        self.build = build

    def current(self) -> list[int]:
        return list(getattr(self.build.buckets, self.attribute))

    def describe(self) -> dict:
        return {"buckets": self.current(), **super().describe()}

    def rebuild(self, sizes: list[int], source: str) -> tuple[int, int]:
        return self.build.switch({self.attribute: list(sizes)}, f"{self.name} rebucket {self.family} "
                                                                 f"{self.switches + 1}")


def families(build: Any, name: str, replica: str, usage: Any) -> dict[str, Callable[[int], BucketRebucketing]]:
    """A generate model's lists that may be auto (LEARNED), by their GenerationSettings field, for
    buckets/learn.attach: ``build`` is its compiling.GenerationBuild, ``usage`` what its engines record."""
    return {learned[1]: functools.partial(BucketRebucketing, build, name, replica, usage, learned)
            for learned in LEARNED}


def describe(rebucketings: list[BucketRebucketing]) -> dict:
    """What the model's metadata says of them (``parameters.rebucketing``): per auto list, by its model.yaml field,
    the buckets served now, how often it looks, its switches and its state."""
    return {r.what: r.describe() for r in rebucketings}
