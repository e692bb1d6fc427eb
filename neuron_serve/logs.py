"""The partitioner's log lines, on ``neuron_serve`` and on torch-neuronx's ``Neuron`` logger.

The graph partitioner app note configures ``logging.getLogger("Neuron")`` (its level
only) and shows lines like ``Neuron: Num Partitions: 2``. So code written against that
note sees them here too, every partitioner line goes to both loggers, and the ``Neuron``
logger has its own stderr handler with that format. It does not propagate: torch-xla
calls ``logging.basicConfig()`` when imported, so a propagated record would print a
second time as ``INFO:Neuron:...``. To send the lines elsewhere, add a handler to the
``Neuron`` logger.
"""

from __future__ import annotations

import logging
from typing import Any

NEURON_LOGGER = "Neuron"
NEURON_FORMAT = "%(name)s: %(message)s"  # "Neuron: Num Partitions: 2", as the app note shows

_serve = logging.getLogger("neuron_serve")
neuron = logging.getLogger(NEURON_LOGGER)


def _configured(record: logging.LogRecord) -> bool:
    """Print only once the ``Neuron`` logger's own level is set (the app note's set-up).

    A level set on the root alone (``neuron-serve``'s CLI and replicas) leaves these
    lines to the ``neuron_serve`` logger, so they are not printed twice.
    """
    return neuron.level != logging.NOTSET


def _install() -> None:
    if not any(getattr(h, "_neuron_serve", False) for h in neuron.handlers):
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter(NEURON_FORMAT))
        handler.addFilter(_configured)
        handler._neuron_serve = True  # type: ignore[attr-defined]
        neuron.addHandler(handler)
        neuron.propagate = False


_install()


def partitioner_info(message: str, *args: Any) -> None:
    """Log one partitioner line at INFO to ``neuron_serve`` and to ``Neuron``."""
    _serve.info(message, *args)
    neuron.info(message, *args)
