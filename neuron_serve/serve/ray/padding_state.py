"""What each replica's buckets padded, in Ray's KV store, for ``neuron-serve status --buckets``.

A replica's metadata says what its own buckets padded (``parameters.padding``, buckets/usage.Usage.summary), but
a model's metadata answers from whichever replica Serve routes to. So each model replica writes that summary under
``padding/{model}/{replica}`` every :data:`PUBLISH_EVERY_S` while it changes, and deletes the key when it stops;
``status`` reads every key and adds up a model's replicas (buckets/usage.merged_summaries).
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any, Callable

from ray.experimental import internal_kv

from . import compile_state
from .grpc_port import NAMESPACE

logger = logging.getLogger("neuron_serve")

PREFIX = "padding/"
PUBLISH_EVERY_S = 2.0  # how stale `status --buckets` may be; a write only when the counts changed


def _key(model: str, replica: str) -> str:
    return f"{PREFIX}{model}/{replica}"


def _write(key: str, summary: dict) -> None:
    try:
        internal_kv._internal_kv_put(key, json.dumps(summary), namespace=NAMESPACE)  # noqa: SLF001
    except Exception as exc:  # Ray going down, or its GCS busy: the next change writes it again
        logger.debug("padding of %s not recorded: %s", key, exc)


def track(plane: Any, replica: str) -> Callable[[], None]:
    """Publish ``plane``'s padding (its metadata's) while it changes, from the running event loop; returns the
    function that stops it and removes the key (the replica stops)."""
    key = _key(plane.name, replica)
    loop = asyncio.get_running_loop()

    async def publish() -> None:
        last = None
        while True:
            try:
                summary = plane.metadata().get("parameters", {}).get("padding") or {}
            except Exception as exc:  # a plane stopping under it: the next round, or untrack, settles it
                logger.debug("padding of %s not read: %s", key, exc)
                summary = last
            if summary != last:
                await loop.run_in_executor(None, _write, key, summary)  # a GCS round trip, off the event loop
                last = summary
            await asyncio.sleep(PUBLISH_EVERY_S)

    task = loop.create_task(publish())

    def untrack() -> None:
        task.cancel()
        try:
            internal_kv._internal_kv_del(key, namespace=NAMESPACE)  # noqa: SLF001
        except Exception as exc:  # Ray going down: the key goes with it
            logger.debug("padding %s not removed: %s", key, exc)
    return untrack


def read() -> dict[str, dict[str, dict]]:
    """Every model's replicas' padding summaries: model -> replica -> summary."""
    return compile_state.read(PREFIX)


def forget(models: list[str] | None = None) -> None:
    """Drop the summaries of ``models`` (every model with None): they are being stopped."""
    compile_state.forget(models, PREFIX)
