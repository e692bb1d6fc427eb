"""The partitioner's log lines, on ``neuron_serve`` and on torch-neuronx's ``Neuron`` logger.

The graph partitioner app note configures ``logging.getLogger("Neuron")`` (its level
only) and shows lines like ``Neuron: Num Partitions: 2``. So code written against that
note sees them here too, every partitioner line goes to both loggers, and the ``Neuron``
logger has its own stderr handler with that format. It does not propagate: torch-xla
calls ``logging.basicConfig()`` when imported, so a propagated record would print a
second time as ``INFO:Neuron:...``. To send the lines elsewhere, add a handler to the
``Neuron`` logger.

``neuron-serve``'s commands that compile (``deploy``'s replicas, ``build``) call
:func:`configure`: they print a progress line per compiled model and a placement summary
instead, and the operator lists go to ``neuron_serve`` at DEBUG, which ``--verbose``
(``NEURON_SERVE_VERBOSE=1`` in a replica) prints. The ``Neuron`` logger is unchanged.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any, TextIO

NEURON_LOGGER = "Neuron"
NEURON_FORMAT = "%(name)s: %(message)s"  # "Neuron: Num Partitions: 2", as the app note shows
FORMAT = "%(name)s: %(message)s"  # neuron-serve's commands and replicas: "neuron_serve: ..."
# Set by `neuron-serve -v` and passed to the replicas it starts: their operator lists are printed too.
VERBOSE_ENV = "NEURON_SERVE_VERBOSE"

_serve = logging.getLogger("neuron_serve")
neuron = logging.getLogger(NEURON_LOGGER)
# The level of the partitioner's lines on ``neuron_serve``: INFO, as torch-neuronx's, until a
# command that prints its own summary of them sets DEBUG (configure).
_partitioner_level = logging.INFO


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
    """Log one partitioner line to ``neuron_serve`` (at INFO; at DEBUG after :func:`configure`)
    and at INFO to ``Neuron``."""
    _serve.log(_partitioner_level, message, *args)
    neuron.info(message, *args)


def operator_lists_shown() -> bool:
    """Whether ``neuron_serve`` prints the partitioner's lines (else a summary points to ``--verbose``)."""
    return _serve.isEnabledFor(_partitioner_level)


def verbose_from_env() -> bool:
    return os.environ.get(VERBOSE_ENV, "").strip().lower() not in ("", "0", "false", "no")


def configure(verbose: bool | None = None, *, operator_lists: bool = False, stream: TextIO | None = None) -> None:
    """Logging as neuron-serve's commands and replicas print it: ``name: message`` on stderr.

    ``neuron_serve`` logs at INFO (DEBUG when ``verbose``; None reads :data:`VERBOSE_ENV`).
    The partitioner's operator lists are logged at DEBUG, so only ``verbose`` prints them,
    unless ``operator_lists`` (``neuron-serve analyze``, whose output they are). ``stream``:
    where the root handler writes, when the root has none yet (default ``sys.stderr``).
    """
    global _partitioner_level
    if verbose is None:
        verbose = verbose_from_env()
    logging.basicConfig(level=logging.INFO, format=FORMAT, stream=stream or sys.stderr)
    _serve.setLevel(logging.DEBUG if verbose else logging.INFO)
    _partitioner_level = logging.INFO if operator_lists else logging.DEBUG
