"""The Ray Serve deployment of a pooling model (task: embed, score, classify).

A replica builds the model (the compiled graph over length buckets and batch sizes, its spec
and tokenizer: neuron_serve.pooling.build), is ready on its first compiled model and takes
the others as they compile, loads it on its cores through the infer data plane, and serves the pooling routes and OIP v2 (HTTP and gRPC) under
``/v2/models/{name}``. The server app's ``/v1`` pooling routes find the model by the body's
``model`` and call ``pooling`` on a replica through a Serve handle.
"""

from __future__ import annotations

from ray import serve

from ...assembly.queue import READY, compile_queue
from ...config.schema import ModelConfig
from ...pooling.tokens import Tokens
from ..infer import plane as dataplane
from ..infer.plane import ModelDataPlane
from ..pooling import plane as pooling_plane
from ..pooling.answers import answer
from ..pooling.http import pooling_app
from ..pooling.plane import PoolingPlane
from .applications import POOLING
from .oip_replica import OipReplica

DRAIN_S = 30  # as an infer replica's
_POOLING_API = pooling_app()


@serve.deployment(name=POOLING, graceful_shutdown_timeout_s=DRAIN_S, health_check_period_s=5,
                  max_constructor_retry_count=1)
@serve.ingress(_POOLING_API)
class PoolingServer(OipReplica):
    """One replica of one pooling model: builds it on construction, then serves its routes and OIP v2."""

    async def __init__(self, config: dict, base_dir: str | None, grpc_options: dict | None = None) -> None:
        parsed, replica = await self._build(config, base_dir, build_plane)
        # neuron-serve status: its compiled models (the data plane's) and what its length buckets padded.
        self._serve(self.plane.data, replica)
        await self._serve_grpc(grpc_options, parsed.name, replica)

    def _data(self) -> ModelDataPlane:
        return self.plane.data

    def _set_current(self, plane: PoolingPlane | None) -> None:
        # OIP v2 over HTTP and gRPC, on the same queue and cores
        dataplane.set_current(plane.data if plane is not None else None)
        pooling_plane.set_current(plane)

    async def pooling(self, route: str, body: bytes) -> tuple[int, dict[str, str], bytes]:
        """A pooling route's request forwarded by the server app: (status, headers, body)."""
        plane = pooling_plane.current()
        found = await answer(plane, route, body)
        return found.status, found.headers, found.body

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
