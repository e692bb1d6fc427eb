"""The models' Serve applications as the server app sees them: their states, their kinds, and calls to them.

Each model is its own application; the deployment inside says what it serves: ``model``
(task: infer), ``generate`` and ``pooling`` (task: embed, score, classify). The server app
reads the states from Serve's controller (cached briefly), forwards OpenAI and pooling
requests to the application a request names, and relays gRPC calls through handles.
"""

from __future__ import annotations

import asyncio
import time

from ray import serve

from ...errors import NeuronServeError
from . import adapter_registry, cluster, generate_deployment

SERVER_APP = cluster.SERVER_APP
POOLING = "pooling"  # the deployment name of a pooling model's application
STATUS_TTL_S = 1.0

_status_cache: tuple[float, dict[str, str], dict[str, str]] = (0.0, {}, {})


async def statuses() -> tuple[dict[str, str], dict[str, str]]:
    """(every model application's state, its kind: "infer", "generate" or "pooling"), from the Serve
    controller (cached briefly)."""
    global _status_cache
    stamp, cached, kinds = _status_cache
    if time.monotonic() - stamp < STATUS_TTL_S:
        return cached, kinds
    status = await asyncio.get_running_loop().run_in_executor(None, serve.status)
    states, kinds = {}, {}
    for name, app in status.applications.items():
        if name == SERVER_APP:
            continue
        value = str(app.status.value if hasattr(app.status, "value") else app.status)
        states[name] = {"RUNNING": "ready", "DEPLOY_FAILED": f"failed: {app.message}"}.get(value, value.lower())
        kinds[name] = "generate" if generate_deployment.DEPLOYMENT in app.deployments else \
            "pooling" if POOLING in app.deployments else "infer"
    _status_cache = (time.monotonic(), states, kinds)
    return states, kinds


async def model_states() -> dict[str, str]:
    """Every model application's state: "ready", "failed: ..." or Serve's state in lower case."""
    return (await statuses())[0]


async def _of_kind(kind: str) -> dict[str, str]:
    states, kinds = await statuses()
    return {name: state for name, state in states.items() if kinds.get(name) == kind}


async def generate_states() -> dict[str, str]:
    """The states of the task: generate models (those the OpenAI completion routes serve)."""
    return await _of_kind("generate")


async def pooling_states() -> dict[str, str]:
    """The states of the pooling models (those the embedding, rerank, score and classify routes serve)."""
    return await _of_kind("pooling")


async def model_card(name: str) -> dict:
    """What ``GET /v1/models`` says of generate or pooling model ``name`` beyond its id, from one of its replicas
    (nothing when none answers: the list still names it)."""
    try:
        kind, meta = await call_model(name, "metadata", b"")
    except Exception:  # noqa: BLE001 - a replica going away between the status and the call
        return {}
    parameters = meta.get("parameters", {}) if kind == "ok" else {}
    # "compile": the replica's compiled models by state (an infer or pooling model's metadata says them,
    # ModelDataPlane.compile_state; a generate model's, once its engines compile on the compile queue).
    return {k: parameters[k] for k in ("max_model_len", "tensor_parallel_size", "task", "dtype", "quantization",
                                       "kv_cache_dtype", "compile", "lora") if k in parameters}


_handles: dict = {}


async def _handle(name: str):
    handle = _handles.get(name)
    if handle is None:
        handle = await asyncio.get_running_loop().run_in_executor(None, serve.get_app_handle, name)
        _handles[name] = handle
    return handle


async def call_model(name: str, method: str, payload: bytes) -> tuple:
    """Forward a gRPC call to a replica of model ``name`` (its Serve application)."""
    return await (await _handle(name)).grpc_call.remote(method, payload)


async def forward_pooling(name: str, route: str, body: bytes) -> tuple[int, dict[str, str], bytes]:
    """A pooling route's request for model ``name``, answered by one of its replicas: (status, headers, body)."""
    return await (await _handle(name)).pooling.remote(route, body)


class Adapters:
    """The server's LoRA adapters (openai_routes.AdapterControl): the registry in Ray's key-value store, a load
    tried on one replica of the base model before the registry lists it."""

    async def entries(self) -> dict[str, dict]:
        return await asyncio.get_running_loop().run_in_executor(None, adapter_registry.entries)

    async def entry(self, name: str) -> dict | None:
        return await asyncio.get_running_loop().run_in_executor(None, adapter_registry.get, name)

    async def load(self, base: str, name: str, path: str | None) -> None:
        loop = asyncio.get_running_loop()
        if path is None:  # the routes refuse it at once; a replica holding it drops it now or on its next request
            await loop.run_in_executor(None, adapter_registry.remove, name)
        source = (path, time.time_ns()) if path is not None else None  # a new version: every replica reads it again
        outcome = await (await _handle(base)).load_adapter.remote(name, source)
        if outcome[0] == "error":
            _, status, message = outcome
            raise AdapterRefused(message, status)
        if source is not None:
            await loop.run_in_executor(None, adapter_registry.put, name, base, *source)


class AdapterRefused(NeuronServeError):
    """A replica refused an adapter: its status and message (the file and the reason)."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.http_status = status
