"""A pooling replica's own metrics (``neuron_serve.metrics``), beside the infer metrics its data plane records.

Updates are queued on the data plane's `DeferredMetrics` and applied once the answer is
out, as the infer plane's are.
"""

from __future__ import annotations

from typing import Any

from ... import metrics
from ..infer.observer import DeferredMetrics


class PoolingMetrics:
    """Requests by API and outcome, inputs, tokens and bucket padding of one model on one replica."""

    def __init__(self, model: str, replica: str, deferred: DeferredMetrics) -> None:
        self._labels = {"model": model, "replica": replica}
        self._tokens = metrics.PROMPT_TOKENS.labels(model_name=model, replica=replica)
        self._padding = metrics.PADDING_TOKENS.labels(**self._labels)
        self._children: dict[tuple, Any] = {}
        self.deferred = deferred

    def _child(self, metric: Any, **labels: str) -> Any:
        key = (metric, *labels.values())
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(**self._labels, **labels)
        return child

    def answered(self, api: str, code: int, inputs: int, tokens: int, padded: int) -> None:
        """A request of ``api`` answered with HTTP status ``code``; applied on the event loop's next turn."""
        self.deferred.add(self._record, api, str(code), inputs, tokens, padded)
        self.deferred.flush_soon()

    def bucket_work(self, counters: tuple, real: int, padded: int) -> None:
        """An input of ``real`` tokens ran padded by ``padded`` on a length bucket whose (real, padded) counters
        are ``counters`` (buckets/usage.Usage.record); applied with the answer's other metrics."""
        self.deferred.add(self._work, counters, real, padded)

    @staticmethod
    def _work(counters: tuple, real: int, padded: int) -> None:
        counters[0].inc(real)
        if padded:
            counters[1].inc(padded)

    def _record(self, api: str, code: str, inputs: int, tokens: int, padded: int) -> None:
        self._child(metrics.POOLING_REQUESTS, api=api, code=code).inc()
        if inputs:
            self._child(metrics.POOLING_INPUTS, api=api).inc(inputs)
            self._tokens.inc(tokens)
            self._padding.inc(padded)
