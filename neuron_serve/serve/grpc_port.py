"""Who holds the shared gRPC port, as recorded in Ray's KV store.

The server app listens on the port only while no model is ready and records whether it
does, so that ``deploy`` says ready only once the models' replicas have the port. Each
model replica registers the private address its relayed calls go to (grpc_service.Relay).
"""

from __future__ import annotations

import asyncio
import time

from ray.experimental import internal_kv

from ..config import ModelConfig

NAMESPACE = "neuron-serve"  # the deployment's Ray namespace (deployment.SERVER_APP)
LISTENING_KEY = "grpc-server-app-listening"
HAND_OVER_WAIT_S = 15.0
# One key per model replica: "grpc-relay/{model}/{replica}/{address}" (model names have no "/").
RELAY_PREFIX = "grpc-relay/"


def options(configs: list[ModelConfig], host: str, port: int | None) -> dict | None:
    """Where the gRPC service listens (``port`` overrides the first model.yaml's), or
    None when the first model.yaml turns it off and no port is given."""
    first = configs[0].grpc
    if port is None and not first.enabled:
        return None
    return {"host": host, "port": port or first.port,
            "max_message_bytes": max(c.http.max_request_bytes for c in configs)}


def record_listening(on: bool) -> None:
    """The server app says whether it listens on the port."""
    internal_kv._internal_kv_put(LISTENING_KEY, b"1" if on else b"0", namespace=NAMESPACE)  # noqa: SLF001


def wait_for_hand_over() -> None:
    """Wait until the server app has left the port to the models' replicas, so that no
    client connecting after deploy says ready lands on a server about to close."""
    deadline = time.monotonic() + HAND_OVER_WAIT_S
    while time.monotonic() < deadline:
        if internal_kv._internal_kv_get(LISTENING_KEY, namespace=NAMESPACE) == b"0":  # noqa: SLF001
            return
        time.sleep(0.2)


async def register_relay(model: str, replica: str, address: str) -> str:
    """Record a model replica's private address; returns the key to unregister it with."""
    key = f"{RELAY_PREFIX}{model}/{replica}/{address}"
    await asyncio.get_running_loop().run_in_executor(
        None, lambda: internal_kv._internal_kv_put(key, b"", namespace=NAMESPACE))  # noqa: SLF001
    return key


async def unregister_relay(key: str) -> None:
    await asyncio.get_running_loop().run_in_executor(
        None, lambda: internal_kv._internal_kv_del(key, namespace=NAMESPACE))  # noqa: SLF001


async def relay_addresses() -> dict[str, list[str]]:
    """Every model's registered private gRPC addresses (the replicas' relay ports)."""
    keys = await asyncio.get_running_loop().run_in_executor(
        None, lambda: internal_kv._internal_kv_list(RELAY_PREFIX, namespace=NAMESPACE))  # noqa: SLF001
    addresses: dict[str, list[str]] = {}
    for key in keys:
        model, _replica, address = key.decode()[len(RELAY_PREFIX):].split("/", 2)
        addresses.setdefault(model, []).append(address)
    return {model: sorted(found) for model, found in addresses.items()}
