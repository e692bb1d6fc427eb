"""Compile progress: a bar on a terminal, one log line per compiled model otherwise.

On Neuron a subgraph can take minutes to compile, so a build says what it is doing. On a
terminal that is a tqdm bar on stderr; in a log (a Ray replica, CI, a pod) it is one
``neuron_serve`` line per compiled model (each shape bucket at each batch size), with each
accelerator subgraph's compile at DEBUG. Once every model is compiled, one line sums up
where their subgraphs and operators were placed.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import os
import sys
import time
from typing import Iterator, Sequence

from .. import logs
from ..model import Partition

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
        self.tty = _on_terminal() if tty is None else tty
        self.partitions: list[list[Partition]] = []  # each compiled model's, in compile order
        self._at: int | None = None  # the shape bucket being compiled, when told (at); else counted
        self._step_started = time.perf_counter()
        self._bar = None
        if self.tty:
            from tqdm import tqdm  # noqa: PLC0415

            self._bar = tqdm(total=self.buckets, desc=f"compiling {model}", unit="bucket", file=sys.stderr, leave=True)

    @contextlib.contextmanager
    def subgraph(self, name: str, index: int, total: int) -> Iterator[None]:
        """Time one accelerator subgraph's compile and report it."""
        where = f"{self.step_label()}: subgraph {name} ({index}/{total})"
        if self._bar is not None:
            batch = f" batch {self.batch}" if self.batch is not None else ""
            self._bar.set_postfix_str(f"{name} {index}/{total}{batch}")
        else:
            logger.debug("compiling %s", where)
        started = time.perf_counter()
        yield
        if self._bar is None:
            logger.debug("compiled %s in %.1fs", where, time.perf_counter() - started)

    def at(self, bucket: int, batch: int | None) -> None:
        """The next compiled model is shape bucket ``bucket`` (0-based) at batch size ``batch``: for
        builds that compile them in another order than bucket by bucket (a compile queue's)."""
        self._at, self.batch = bucket, batch
        self._step_started = time.perf_counter()

    def step_label(self) -> str:
        """The compiled model being built: its shape bucket (when several) and batch size (when several)."""
        index = self._at if self._at is not None else self.bucket // self.batch_sizes
        parts = []
        if self.labels is not None and index < len(self.labels):
            parts.append(self.labels[index])
        elif self.shape_buckets > 1:
            parts.append(f"bucket {index + 1}")
        if self.batch is not None and self.batch_sizes > 1:
            parts.append(f"batch {self.batch}")
        return " ".join([self.model, *parts])

    def bucket_done(self, partitions: Sequence[Partition] = ()) -> None:
        """One compiled model done (a shape bucket at a batch size), placed as ``partitions``."""
        now = time.perf_counter()
        self.partitions.append(list(partitions))
        if self._bar is not None:
            self._bar.update(1)
        else:
            logger.info("compiled %s (%d of %d) in %.1f s", self.step_label(), self.bucket + 1, self.buckets,
                        now - self._step_started)
        self.bucket += 1
        self._step_started = now

    def summary(self) -> str:
        """Where the compiled models' subgraphs and operators were placed, in one line."""
        parts = [p for compiled in self.partitions for p in compiled]
        accel = [p for p in parts if not p.on_cpu]
        cpu = [p for p in parts if p.on_cpu]
        cpu_ops = sorted({op for p in cpu for op in p.op_counts})
        line = (f"placement of {self.model} ({_count(len(self.partitions), 'compiled model')}): "
                f"{_count(len(accel), 'accelerator subgraph')}, {_count(len(cpu), 'CPU subgraph')}; "
                f"operators: {sum(p.size for p in accel)} on the accelerator, {sum(p.size for p in cpu)} on CPU")
        if cpu_ops:
            shown = ", ".join(cpu_ops[:5]) + (f" and {len(cpu_ops) - 5} more" if len(cpu_ops) > 5 else "")
            line += f" ({shown})"
        return line

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()

    def finish(self) -> None:
        """Close the bar and log the placement line (when anything was compiled)."""
        self.close()
        if self.partitions:
            hint = "" if logs.operator_lists_shown() else "; --verbose lists them"
            logger.info("%s%s", self.summary(), hint)


def _on_terminal() -> bool:
    """Whether stderr is a terminal, by its file descriptor: a Ray Serve replica's stderr,
    which writes to its log file, answers True to ``isatty()``."""
    try:
        return os.isatty(sys.stderr.fileno())
    except (AttributeError, OSError, ValueError):  # no descriptor: a capture, a notebook
        return False


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


_CURRENT: contextvars.ContextVar[BuildProgress | None] = contextvars.ContextVar("build_progress", default=None)


@contextlib.contextmanager
def reporting(progress: BuildProgress) -> Iterator[BuildProgress]:
    """Make ``progress`` the one that compiles in this context report to."""
    token = _CURRENT.set(progress)
    try:
        yield progress
    except BaseException:
        progress.close()
        raise
    else:
        progress.finish()
    finally:
        _CURRENT.reset(token)


@contextlib.contextmanager
def current(progress: BuildProgress) -> Iterator[BuildProgress]:
    """Make ``progress`` the current one for one step of a build whose steps run apart (compile
    queue jobs); unlike :func:`reporting`, leaving it neither closes it nor logs the placement."""
    token = _CURRENT.set(progress)
    try:
        yield progress
    finally:
        _CURRENT.reset(token)


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


def bucket_done(partitions: Sequence[Partition] = ()) -> None:
    """One compiled model of the current build done, placed as ``partitions``."""
    progress = _CURRENT.get()
    if progress is not None:
        progress.bucket_done(partitions)


def failures_said(failures: list[tuple[str, str]]) -> str:
    """The end of a background compile's closing line: each failed compile and its reason, nothing when none
    failed (a clean start prints no "failed")."""
    if not failures:
        return ""
    return f", {len(failures)} failed" + "".join(f"; {label} failed: {reason}" for label, reason in failures)
