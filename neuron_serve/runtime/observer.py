"""What the runtime tells of its work, to one observer passed down once.

The serving edge hands one `RuntimeObserver` to the request queue and the runner (which
hands it to its pipelines), rather than a callback per event: the replica's metrics
(``serve/infer/observer.py``, which writes ``neuron_serve.metrics``), a test's probe, or
nothing. The runtime knows no metric.

The methods are called on the hot path, some on a core's thread, so an implementation
notes the event and returns (the replica's queues its metric updates and applies them
once the answer is out). An exception raised by ``batch`` is logged and ignored; the
others must not raise.
"""

from __future__ import annotations


class RuntimeObserver:
    """The runtime's events; each method does nothing here: override those wanted."""

    def batch(self, rows: int, waits: list[float]) -> None:
        """A batch starts (the request queue): its rows, and each request's seconds since it was submitted."""

    def padding(self, padded: int) -> None:
        """The padded rows of one batch, all its chunks of every shape bucket (the runner)."""

    def chunk(self, core: int, batch_size: int, padded: int) -> None:
        """A chunk goes to ``core`` (the runner): the compiled batch size that runs it, its padded rows."""

    def shape(self, size: int, bucket: int) -> None:
        """A request of ``size`` along a model's one bucketed dim runs on the shape bucket of size ``bucket``."""

    def transfer(self, stage: str, core: int, size_bytes: int) -> None:
        """A pipeline stage starts on ``core`` with ``size_bytes`` of input tensors (the pipeline)."""

    def stage(self, partition: str, device: str, core: int, seconds: float) -> None:
        """A partition ran on ``device`` of ``core`` for ``seconds`` (the pipeline, on the thread that ran it)."""
