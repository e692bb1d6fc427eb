"""The Ray Serve deployment of a ``task: generate`` model: its engines run beside the replicas.

Each replica starts an engine process (``generation/process/client.py``) that compiles and runs
its engines (one per core, or one per group of ``tensor_parallel_size`` cores, each
group in a process of its own), so the replica's event loop and the engines' steps never wait
for each other's GIL.

Each model is its own Serve application at ``/v2/models/{name}`` (HAProxy sends its
routes straight to the replicas); the server app's OpenAI routes at ``/v1`` find the
model by the request's ``model`` and call ``openai`` through a streaming Serve handle,
as Ray Serve LLM's router does.
"""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator

from ray import serve

from ...config.schema import ModelConfig
from ...config.generation import GenerationSettings
from ...errors import ModelNotReady, NeuronServeError
from ...generation.frontend.processor import Frontend
from . import adapter_registry
from ..generate import plane as generate_plane
from ..generate.answers import openai_answer, openai_error
from ..generate.http import generate_app
from ..generate.plane import GenerationPlane, UnknownModel
from .replica_base import Replica

DEPLOYMENT = "generate"  # the deployment name tells the server app which applications generate
DRAIN_S = 30
# Requests a replica holds besides its running and waiting sequences (metadata, probes).
ONGOING_MARGIN = 16

_GENERATE_API = generate_app()


@serve.deployment(name=DEPLOYMENT, graceful_shutdown_timeout_s=DRAIN_S, health_check_period_s=5,
                  max_constructor_retry_count=1)
@serve.ingress(_GENERATE_API)
class GenerateServer(Replica):
    """One replica of one generate model: builds its engines (one per core), then serves text."""

    async def __init__(self, config: dict, base_dir: str | None) -> None:
        parsed, replica = await self._build(config, base_dir, build_plane)
        loop = asyncio.get_running_loop()
        # The model.yaml's adapters, for the server app's routes (and every replica: each records the same).
        for name, path in self.plane.adapters.items():
            await loop.run_in_executor(None, adapter_registry.put, name, parsed.name, path, 0)
        self._serve(self.plane, replica)

    def _set_current(self, plane: GenerationPlane | None) -> None:
        generate_plane.set_current(plane)

    async def openai(self, kind: str, request: Any) -> AsyncIterator:
        """An OpenAI request the server app decoded and forwarded: (status, headers, streamed), then the
        answer's bytes."""
        plane = generate_plane.current()
        if plane is None or not plane.ready():
            answer = openai_error(ModelNotReady("model is loading or shutting down"))
        else:
            adapter = serve.get_multiplexed_model_id()
            if adapter:
                try:
                    await self._hold(adapter)  # Serve now routes this adapter's requests here first
                except Exception:  # noqa: BLE001 - openai_answer answers it (unknown: 404; refused: 400)
                    pass
            answer = await openai_answer(plane, kind, request)
        yield (answer.status, answer.headers, answer.streamed)
        if not answer.streamed:
            yield answer.body
            return
        try:
            async for chunk in answer.body:
                yield chunk
        finally:  # cancelled when the client left: the sequences abort now
            await answer.body.aclose()

    @serve.multiplexed(max_num_models_per_replica=-1)  # the engines' own LRU bounds what is held (max_cpu_loras)
    async def _hold(self, adapter: str) -> str:
        """Adapter ``adapter`` loaded into this replica's engines, for Serve's model multiplexing: the server app
        names it as the call's multiplexed model id, and Serve prefers the replicas that hold it."""
        await generate_plane.current().adapter_for(adapter)
        return adapter

    async def load_adapter(self, name: str, source: tuple[str, int] | None) -> tuple:
        """The server app's load (``source``: directory, version) or unload (None) of an adapter: ("ok",) or
        ("error", status, message)."""
        plane = generate_plane.current()
        if plane is None or not plane.ready():
            return ("error", 503, "model is loading or shutting down")
        try:
            await plane.load_adapter(name, source)
        except UnknownModel:
            pass  # an unload on a replica that never held it
        except NeuronServeError as exc:
            return ("error", exc.http_status, str(exc))
        except Exception as exc:  # noqa: BLE001
            return ("error", 500, f"{type(exc).__name__}: {exc}")
        return ("ok",)

    def check_health(self) -> None:
        """Serve's health check: a replica whose engine process has ended is replaced."""
        plane = generate_plane.current()
        if plane is not None and not plane.alive():
            raise RuntimeError(f"model {plane.name!r}: the generation engine process has ended")

    # Not OipReplica's: a generate model answers no OIP v2 inference, so gRPC serves its metadata only.
    async def grpc_call(self, method: str, payload: bytes = b"") -> tuple:
        """A gRPC call forwarded from another replica: metadata is served, inference refused with the routes to use."""
        plane = generate_plane.current()
        if plane is None or not plane.ready():
            return ("error", 503, "model is loading or shutting down")
        if method == "metadata":
            return ("ok", plane.metadata())
        return ("error", 400, f"model {plane.name!r} is a task: generate model; gRPC serves task: infer models. Send "
                              f"text over HTTP: POST /v2/models/{plane.name}/generate or the OpenAI routes under /v1.")

def build_plane(config: ModelConfig, base_dir: str | None, replica: str) -> GenerationPlane:
    """The replica's plane over its front end and engines, which run in a process of their own
    (generation/process/client.py)."""
    from ...generation.process.client import start_engines  # noqa: PLC0415

    settings = config.generation or GenerationSettings()
    engines = start_engines(config.model_dump(mode="json", exclude_unset=True), base_dir, replica,
                            config.cores_per_replica, settings.tensor_parallel_size)
    return GenerationPlane(config, Frontend(engines, engines.info, engines.tokenizer), replica,
                           cores=config.cores_per_replica, base_dir=base_dir,
                           registry=adapter_registry.ModelAdapters(config.name))


def max_ongoing_requests(config: ModelConfig) -> int:
    """Every sequence a replica can run or queue, and a margin: past that its engine answers 503 itself."""
    settings = config.generation or GenerationSettings()
    engines = config.cores_per_replica // settings.tensor_parallel_size
    return engines * settings.max_num_seqs + settings.max_waiting + ONGOING_MARGIN


def application(config: ModelConfig, base_dir: str | None, options: dict):
    """The Serve application of one generate model, with ``options`` (resources, replicas) as deployment.py sets them."""
    options = {**options, "max_ongoing_requests": max_ongoing_requests(config)}
    # Only the fields the model.yaml set: a generate config refuses the infer-only ones even at their defaults.
    return GenerateServer.options(**options).bind(config.model_dump(mode="json", exclude_unset=True), base_dir)


_streams: dict = {}


async def forward_openai(name: str, kind: str, request: Any, adapter: str | None = None):
    """Call ``openai`` on a replica of generate model ``name`` with a decoded request (for its LoRA ``adapter``:
    a replica that holds it, by Serve's model multiplexing): a response generator (cancel it to abort)."""
    handle = _streams.get(name)
    if handle is None:
        found = await asyncio.get_running_loop().run_in_executor(None, serve.get_app_handle, name)
        handle = _streams[name] = found.options(stream=True)
    if adapter is not None:
        handle = handle.options(multiplexed_model_id=adapter)
    return handle.openai.remote(kind, request)

