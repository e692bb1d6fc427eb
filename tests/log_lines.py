"""The neuron_serve logger's lines, from every thread, for a test that reads what a person would."""

from __future__ import annotations

import contextlib
import logging


@contextlib.contextmanager
def capture():
    """The neuron_serve logger's messages while the block runs (from every thread)."""
    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    logger, handler = logging.getLogger("neuron_serve"), Keep(logging.INFO)
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield lines
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
