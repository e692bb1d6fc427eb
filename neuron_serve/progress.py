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

    def __init__(self, model: str, buckets: int, *, tty: bool | None = None) -> None:
        self.model = model
        self.buckets = buckets
        self.bucket = 0
        self.tty = sys.stderr.isatty() if tty is None else tty
        self._bar = None
        if self.tty:
            from tqdm import tqdm  # noqa: PLC0415

            self._bar = tqdm(total=buckets, desc=f"compiling {model}", unit="bucket", file=sys.stderr, leave=True)

    def bucket_label(self) -> str:
        return f"bucket {self.bucket + 1}/{self.buckets}" if self.buckets > 1 else "model"

    @contextlib.contextmanager
    def subgraph(self, name: str, index: int, total: int) -> Iterator[None]:
        """Time one accelerator subgraph's compile and report it."""
        where = f"{self.model} {self.bucket_label()}: subgraph {name} ({index}/{total})"
        if self._bar is not None:
            self._bar.set_postfix_str(f"{name} {index}/{total}")
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


def bucket_done() -> None:
    progress = _CURRENT.get()
    if progress is not None:
        progress.bucket_done()
