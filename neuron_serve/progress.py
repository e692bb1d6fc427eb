"""Compile progress: a bar on a terminal, one log line per step otherwise.

On Neuron a subgraph can take minutes to compile, so a build says what it is doing:
per bucket and per accelerator subgraph. On a terminal that is a tqdm bar on stderr;
in a log (a Ray replica, CI, a pod) it is plain ``neuron_serve`` log lines.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import sys
import time
from typing import Iterator

logger = logging.getLogger("neuron_serve")


class BuildProgress:
    """Progress of one model build over its buckets and their subgraphs."""

    def __init__(self, model: str, buckets: int, *, batch_sizes: int = 1, tty: bool | None = None,
                 labels: list[str] | None = None) -> None:
        self.model = model
        self.labels = labels  # a name per shape bucket (a generation model's prefill_32, decode_4x128, ...)
        self.shape_buckets = buckets
        self.batch_sizes = batch_sizes
        self.buckets = buckets * batch_sizes  # one step per shape bucket and compiled batch size
        self.bucket = 0  # steps done
        self.batch: int | None = None  # the batch size being compiled, when several are
        self.tty = sys.stderr.isatty() if tty is None else tty
        self._bar = None
        if self.tty:
            from tqdm import tqdm  # noqa: PLC0415

            self._bar = tqdm(total=self.buckets, desc=f"compiling {model}", unit="bucket", file=sys.stderr, leave=True)

    def bucket_label(self) -> str:
        index = self.bucket // self.batch_sizes
        label = f"bucket {index + 1}/{self.shape_buckets}" if self.shape_buckets > 1 else "model"
        if self.labels is not None and index < len(self.labels):
            label += f" ({self.labels[index]})"
        return label if self.batch is None else f"{label} (batch {self.batch})"

    @contextlib.contextmanager
    def subgraph(self, name: str, index: int, total: int) -> Iterator[None]:
        """Time one accelerator subgraph's compile and report it."""
        where = f"{self.model} {self.bucket_label()}: subgraph {name} ({index}/{total})"
        if self._bar is not None:
            batch = f" batch {self.batch}" if self.batch is not None else ""
            self._bar.set_postfix_str(f"{name} {index}/{total}{batch}")
        else:
            logger.info("compiling %s", where)
        started = time.perf_counter()
        yield
        if self._bar is None:
            logger.info("compiled %s in %.1fs", where, time.perf_counter() - started)

    def bucket_done(self) -> None:
        self.bucket += 1
        if self._bar is not None:
            self._bar.update(1)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


_CURRENT: contextvars.ContextVar[BuildProgress | None] = contextvars.ContextVar("build_progress", default=None)


@contextlib.contextmanager
def reporting(progress: BuildProgress) -> Iterator[BuildProgress]:
    """Make ``progress`` the one that compiles in this context report to."""
    token = _CURRENT.set(progress)
    try:
        yield progress
    finally:
        _CURRENT.reset(token)
        progress.close()


@contextlib.contextmanager
def subgraph(name: str, index: int, total: int) -> Iterator[None]:
    """Report one subgraph compile to the current build, if there is one."""
    progress = _CURRENT.get()
    if progress is None:
        yield
        return
    with progress.subgraph(name, index, total):
        yield


def batch_size(rows: int) -> None:
    """Say which compiled batch size the next bucket is compiled at."""
    progress = _CURRENT.get()
    if progress is not None:
        progress.batch = rows


def bucket_done() -> None:
    progress = _CURRENT.get()
    if progress is not None:
        progress.bucket_done()
