"""The partitioner's log lines, on ``neuron_serve`` and on torch-neuronx's ``Neuron`` logger.

The graph partitioner app note configures ``logging.getLogger("Neuron")`` (its level
only) and shows lines like ``Neuron: Num Partitions: 2``. So code written against that
note sees them here too, every partitioner line goes to both loggers, and the ``Neuron``
logger prints ``Neuron: <message>`` to stderr when nothing else would show it: when the
application has configured no root handler (as the app note's scripts do not). With a
root handler (``logging.basicConfig``, pytest's caplog) the records propagate there
instead, so nothing prints twice.
"""

from __future__ import annotations

import logging
from typing import Any

NEURON_LOGGER = "Neuron"
NEURON_FORMAT = "%(name)s: %(message)s"  # "Neuron: Num Partitions: 2", as the app note shows

_serve = logging.getLogger("neuron_serve")
neuron = logging.getLogger(NEURON_LOGGER)


class _UnlessRootHandles(logging.StreamHandler):
    """Print only when the root logger has no handler to pass the record on to."""

    def emit(self, record: logging.LogRecord) -> None:
        if not logging.getLogger().handlers:
            super().emit(record)


def _install() -> None:
    if not any(isinstance(h, _UnlessRootHandles) for h in neuron.handlers):
        handler = _UnlessRootHandles()
        handler.setFormatter(logging.Formatter(NEURON_FORMAT))
        neuron.addHandler(handler)


_install()


def partitioner_info(message: str, *args: Any) -> None:
    """Log one partitioner line at INFO to ``neuron_serve`` and to ``Neuron``."""
    _serve.info(message, *args)
    neuron.info(message, *args)
