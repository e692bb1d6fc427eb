"""What compiling each of a model's compiled models took on this machine, kept in the compile cache.

A compile's peak host memory, what it kept (its code and bookkeeping) and its seconds are recorded as it ends
(assembly/host_memory.py measures them): the next start's compile queue knows what each compile needs before it
runs it, and ``neuron-serve analyze`` shows them beside the core figures. One entry per model name; nothing is
recorded without a cache.
"""

from __future__ import annotations

from typing import Any

from . import cache as compile_cache

_KIND = "host_memory"


def remember(model: str, label: str, **figures: Any) -> None:
    """Keep what compiling ``model``'s ``label`` took (peak, kept, seconds)."""
    store = compile_cache.current()
    if store is None:
        return
    key = {"model": model}
    records = store.get(_KIND, key) or {}
    records[label] = {k: v for k, v in figures.items() if v is not None}
    store.put(_KIND, key, records)


def remembered(model: str) -> dict[str, dict]:
    """What compiling each of ``model``'s compiled models took when this machine last compiled it (by label)."""
    store = compile_cache.current()
    return (store.get(_KIND, {"model": model}) or {}) if store is not None else {}
