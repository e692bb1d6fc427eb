"""The Ray Serve deployment of a pooling model (task: embed, score, classify).

A replica builds the model (the compiled graph over length buckets and batch sizes, its spec
and tokenizer: neuron_serve.pooling.build), is ready on its first compiled model and takes
the others as they compile, loads it on its cores through the infer data plane, and serves the pooling routes and OIP v2 (HTTP and gRPC) under
``/v2/models/{name}``. The server app's ``/v1`` pooling routes find the model by the body's
``model`` and call ``pooling`` on a replica through a Serve handle.
"""

from __future__ import annotations

import asyncio
import logging
import sys

from ray import serve

from ... import logs
from ...assembly.queue import READY, compile_queue
from ...config.schema import ModelConfig, parse_config
from ...pooling.tokens import Tokens
from ..grpc import service as grpc_service
from ..http import auth
from ..infer import plane as dataplane
from ..infer.plane import ModelDataPlane
from ..pooling import plane as pooling_plane
from ..pooling.answers import answer
from ..pooling.http import pooling_app
from ..pooling.plane import PoolingPlane
from . import compile_state, grpc_port, padding_state
from .applications import POOLING, call_model, model_states

logger = logging.getLogger("neuron_serve")

DRAIN_S = 30  # as an infer replica's
_POOLING_API = pooling_app()


@serve.deployment(name=POOLING, graceful_shutdown_timeout_s=DRAIN_S, health_check_period_s=5,
                  max_constructor_retry_count=1)
@serve.ingress(_POOLING_API)
class PoolingServer:
    """One replica of one pooling model: builds it on construction, then serves its routes and OIP v2."""

    async def __init__(self, config: dict, base_dir: str | None, grpc_options: dict | None = None) -> None:
        logs.configure(stream=sys.__stderr__ or sys.stderr)  # as ModelServer's: on deploy's output
        parsed = parse_config(config)
        auth.configure(auth.resolve_token(parsed))
        replica = serve.get_replica_context().replica_id.unique_id
        loop = asyncio.get_running_loop()
        self.plane = await loop.run_in_executor(None, build_plane, parsed, base_dir, replica)
        self.plane.start()
        dataplane.set_current(self.plane.data)  # OIP v2 over HTTP and gRPC, on the same queue and cores
        pooling_plane.set_current(self.plane)
        # neuron-serve status: its compiled models (the data plane's) and what its length buckets padded.
        self._untrack = compile_state.track(self.plane.data, replica)
        self._unpublish = padding_state.track(self.plane, replica)
        self._grpc = self._relay = self._grpc_key = None
        if grpc_options:
            self._grpc, self._relay, self._grpc_key = await grpc_port.start_for_replica(
                grpc_options, model_states, self._call_model, parsed.name, replica)

    async def _call_model(self, name: str, method: str, payload) -> tuple:
        if name == self.plane.name:
            return await grpc_service.replica_call(self.plane.data, method, payload)
        return await call_model(name, method, payload)

    async def pooling(self, route: str, body: bytes) -> tuple[int, dict[str, str], bytes]:
        """A pooling route's request forwarded by the server app: (status, headers, body)."""
        plane = pooling_plane.current()
        found = await answer(plane, route, body)
        return found.status, found.headers, found.body

    async def grpc_call(self, method: str, payload: bytes = b"") -> tuple:
        """A gRPC call forwarded by another replica's gRPC server (see grpc_service)."""
        found = await grpc_service.replica_call(dataplane.current(), method, payload)
        if found[0] == "ok" and hasattr(found[1], "SerializeToString"):
            return ("ok", found[1].SerializeToString())
        return found

    async def __del__(self) -> None:
        for stop in (getattr(self, "_untrack", None), getattr(self, "_unpublish", None)):
            if stop is not None:
                stop()
        if getattr(self, "_grpc_key", None) is not None:
            try:
                await grpc_port.unregister(self._grpc_key)
            except Exception as exc:  # Ray going down: the key goes with it
                logger.debug("gRPC address not unregistered: %s", exc)
        if getattr(self, "_grpc", None) is not None:
            await self._grpc.stop(grace=5)
        if getattr(self, "_relay", None) is not None:
            await self._relay.close()
        dataplane.set_current(None)
        pooling_plane.set_current(None)
        plane = getattr(self, "plane", None)  # absent when building failed
        if plane is not None:
            await plane.stop()


def build_plane(config: ModelConfig, base_dir: str | None, replica: str) -> PoolingPlane:
    """The replica's pooling plane over its data plane, as an infer model's: ready once the longest length bucket
    at the largest batch size is compiled and loaded (any input fits it); the other compiled models join it as each
    is compiled, in the background (model.yaml's ``background_compile``), all of it on the compile queue."""
    from ...pooling.build import described, staged  # noqa: PLC0415 - the compiler is loaded by replicas only
    from ...buckets.learn import attach  # noqa: PLC0415
    from ...pooling.rebucket import families  # noqa: PLC0415 - as the build

    # The model's directory is read and its graph made on the queue's thread, as every trace.
    loading = compile_queue().submit(f"load {config.name} (pooling model)", lambda: staged(config, base_dir),
                                     priority=READY, group=config.name, kind="load")
    build, spec, tokenizer = loading.future.result()
    planes: list[PoolingPlane] = []

    def load(model) -> PoolingPlane:
        known = described(model, spec)
        data = ModelDataPlane(config, model, replica, parameters=known.describe(), compiles=build.compiles)
        planes.append(PoolingPlane(config, data, Tokens(tokenizer, known), known))
        return planes[0]

    plane = build.start(load, grow=lambda model: planes[0].data.grow(model))
    attach(plane, config.pooling, build, families(plane, config, base_dir, build))
    return plane
