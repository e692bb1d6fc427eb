"""The re-bucketing of a serving replica whose compiled models are a grid (assembly/grid.py): GridRebucketing, the
grid's variant of buckets/learn.py's Rebucketing (which says when it looks and what it proposes), and task: infer's,
BatchSizeRebucketing (``batch_sizes: auto``); pooling/rebucket.py's builds on it for a pooling model's length
buckets. The new grid's models compile on the compile queue while the old ones serve, and are served in one step
(ModelRunner.grow).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from ..buckets.learn import Abandoned, Rebucketing
from ..compile.subgraph import compile_count
from ..model import CompiledModel
from .grid import Entry, GridBuild
from .queue import BACKGROUND, COMPILED, compile_queue


class GridRebucketing(Rebucketing):
    """A variant whose compiled models are a grid (assembly/grid.py): the new grid's entries the replica holds are
    adopted, the others compiled, then the new grid's model is loaded in one step (ModelRunner.grow)."""

    def served(self) -> CompiledModel:
        """The compiled model served now."""
        raise NotImplementedError

    def held(self, model: CompiledModel) -> dict[tuple[int, int], Any]:
        """``model``'s compiled models by the key :meth:`grid` gives a new grid's entries."""
        raise NotImplementedError

    def grid(self, sizes: list[int]) -> tuple[GridBuild, Callable[[Entry], tuple[int, int]]]:
        """The grid of the same module over ``sizes``, and the key of each of its entries in :meth:`held`."""
        raise NotImplementedError

    def apply(self, model: CompiledModel, sizes: list[int], source: str) -> None:
        """Serve ``model`` (compiled over ``sizes``) from now on; on the compile queue's thread (loading compiles)."""
        raise NotImplementedError

    def rebuild(self, sizes: list[int], source: str) -> tuple[int, int]:
        compiles = compile_count()
        grid, key = self.grid(sizes)
        served = self.held(self.served())
        group = compile_queue().group(f"{self.name} rebucket {self.switches + 1}")
        jobs = []
        for entry in grid.order:
            held = served.get(key(entry))
            if held is not None:  # a compiled model at a size kept is kept, not compiled again
                grid.adopt(entry, held)
            else:
                jobs.append(group.submit(grid.label(entry), lambda e=entry: grid.compile(e), priority=BACKGROUND))
        group.wait(jobs)
        failed = [j for j in jobs if j.state != COMPILED]
        if failed:
            raise Abandoned(failed[0])
        model = grid.model()
        was = self.served()
        model.input_names, model.output_names = list(was.input_names), list(was.output_names)
        model.build_info = dataclasses.replace(was.build_info,
                                               compiles=was.build_info.compiles + compile_count() - compiles)
        # Loading onto the cores compiles: on the queue's thread, as every compiled model joins a replica.
        loading = group.submit(f"load {self.name} {self.what} {sizes}",
                               lambda: self.apply(model, sizes, source), priority=BACKGROUND, kind="load")
        group.wait([loading])
        if loading.state != COMPILED:
            raise Abandoned(loading)
        return len(jobs), len(grid.order) - len(jobs)


class BatchSizeRebucketing(GridRebucketing):
    """A task: infer model with ``batch_sizes: auto``: its compiled batch sizes, from the rows of the chunks it ran
    (``plane`` is the replica's serve/infer/plane.ModelDataPlane; ``grid`` the build's GridBuild, whose module and
    example every new batch size is compiled from)."""

    family = "rows"
    what = "batch sizes"
    unit = "chunks"

    def __init__(self, plane: Any, grid: GridBuild, every: int, ready: Callable[[], bool]) -> None:
        super().__init__(plane.config.name, plane.replica, plane.usage, every, ready)
        self.plane = plane
        self.built = grid

    def current(self) -> list[int]:
        return list(self.served().batch_sizes)

    def served(self) -> CompiledModel:
        return self.plane.runner.model

    def held(self, model: CompiledModel) -> dict[tuple[Any, int], Any]:
        # The shape buckets do not change: a compiled model is kept by its shape bucket's sizes and its rows.
        return {(_shape(model.spec, i), bucket.batch_size): bucket
                for i in range(len(model.buckets)) for bucket in model.grid(i)}

    def grid(self, sizes: list[int]) -> tuple[GridBuild, Callable[[Entry], tuple[Any, int]]]:
        grid = self.built.at_batch_sizes(sizes)
        return grid, lambda entry: (_shape(grid.spec, entry.bucket), entry.batch)

    def apply(self, model: CompiledModel, sizes: list[int], source: str) -> None:
        self.plane.grow(model)
        self.plane.parameters["batch_sizes_from"] = source


def families(plane: Any, config: Any, build: Any) -> dict[str, Callable[[int], BatchSizeRebucketing]]:
    """A task: infer model's one list that may be auto, ``batch_sizes`` (with dynamic_batch, which it needs), for
    buckets/learn.attach: ``plane`` is the replica's serve/infer/plane.ModelDataPlane, ``build`` its
    assembly/from_config.StagedBuild."""
    if not config.dynamic_batch:
        return {}
    return {"batch_sizes": lambda every: BatchSizeRebucketing(plane, build.grid, every, build.finished.is_set)}


def _shape(spec: Any, index: int) -> Any:
    """Shape bucket ``index``'s sizes (a served model holds only the buckets that compiled: places may differ)."""
    return tuple(spec.sizes[index]) if spec is not None else index
