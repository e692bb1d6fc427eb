"""Where each replica's compiles stand, in Ray's KV store, for ``neuron-serve status``.

A replica is ready on its first compiled models and compiles the rest in the background
(model.yaml's ``background_compile``), so "running" does not say how much of a model is
compiled. Each model replica writes its compiled models by state (the data plane's
``compile_state``) under ``compile-state/{model}/{replica}`` whenever a compile of it
starts or ends, and deletes the key when it stops; ``status`` reads every key.
"""

from __future__ import annotations

import json
import logging
from typing import Any, Callable

from ray.experimental import internal_kv

from .grpc_port import NAMESPACE

logger = logging.getLogger("neuron_serve")

PREFIX = "compile-state/"


def _key(model: str, replica: str) -> str:
    return f"{PREFIX}{model}/{replica}"


def record(model: str, replica: str, state: dict) -> None:
    """Write one replica's compile state (its compiled models by state)."""
    try:
        internal_kv._internal_kv_put(_key(model, replica), json.dumps(state), namespace=NAMESPACE)  # noqa: SLF001
    except Exception as exc:  # Ray going down, or its GCS busy: status reads the last one written
        logger.debug("compile state of %s not recorded: %s", model, exc)


def track(plane: Any, replica: str) -> Callable[[], None]:
    """Record ``plane``'s compile state now and after each compile of it; returns the function
    that stops recording it and removes it (the replica stops)."""
    key = _key(plane.name, replica)
    record(plane.name, replica, plane.compile_state())
    unsubscribe = None
    if plane.compiles is not None:
        unsubscribe = plane.compiles.subscribe(lambda job: record(plane.name, replica, plane.compile_state()))

    def untrack() -> None:
        if unsubscribe is not None:
            unsubscribe()
        try:
            internal_kv._internal_kv_del(key, namespace=NAMESPACE)  # noqa: SLF001
        except Exception as exc:  # Ray going down: the key goes with it
            logger.debug("compile state %s not removed: %s", key, exc)
    return untrack


def read(prefix: str = PREFIX) -> dict[str, dict[str, dict]]:
    """Every model's replicas' states under ``prefix`` (their compiles; padding_state's too): model -> replica ->
    state."""
    found: dict[str, dict[str, dict]] = {}
    for key in internal_kv._internal_kv_list(prefix, namespace=NAMESPACE):  # noqa: SLF001
        value = internal_kv._internal_kv_get(key, namespace=NAMESPACE)  # noqa: SLF001
        if value:
            model, _, replica = key.decode()[len(prefix):].partition("/")
            found.setdefault(model, {})[replica] = json.loads(value)
    return found


def forget(models: list[str] | None = None, prefix: str = PREFIX) -> None:
    """Drop the states under ``prefix`` of ``models`` (every model with None): they are being stopped."""
    for key in internal_kv._internal_kv_list(prefix, namespace=NAMESPACE):  # noqa: SLF001
        if models is None or key.decode()[len(prefix):].partition("/")[0] in models:
            internal_kv._internal_kv_del(key, namespace=NAMESPACE)  # noqa: SLF001
