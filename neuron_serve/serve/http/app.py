"""The server app, mounted at ``/``: health, server metadata, ``/metrics``, the OpenAPI
document, the OpenAI routes (forwarded to the generate model a request names), the pooling
routes (to the pooling model it names), and the answers for models that are unknown (404)
or still loading (503). Each model's own routes are its plane's app (`serve.infer.http`,
`serve.generate.http`, `serve.pooling.http`).
"""

from __future__ import annotations

from typing import Any, Awaitable, Callable

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response

from ... import metrics
from ...version import __version__
from ...errors import ModelNotFound, ModelNotReady, NeuronServeError
from ...targets.pjrt import emulated
from . import auth, openai_routes, pooling_routes
from .base import error as _error, install_error_handlers
from ..infer import triton as triton_ext

OPENAPI_PATH = "/openapi.json"
HEALTH_LIVE = "/v2/health/live"
HEALTH_READY = "/v2/health/ready"
METRICS_PATH = "/metrics"



ModelStates = Callable[[], Awaitable[dict[str, str]]]  # model name -> "ready" | "loading" | "failed: ..."
# (model, "completions" | "chat", the decoded request, its LoRA adapter or None) -> a Serve response generator:
# (status, headers, streamed), then bytes
ForwardOpenAI = Callable[[str, str, Any, "str | None"], Awaitable[Any]]
# model -> what GET /v1/models says of it beyond its id (max_model_len, tensor_parallel_size)
DescribeModel = Callable[[str], Awaitable[dict]]
# (model, route, body) -> (status, headers, body): a pooling route's request answered by a replica of the model
ForwardPooling = Callable[[str, str, bytes], Awaitable[tuple[int, dict, bytes]]]
# models -> those of them whose ports (HTTP, gRPC, metrics) deploy has not yet seen answer (serve.ray.readiness)
Unchecked = Callable[[list[str]], Awaitable[set[str]]]


def server_app(model_states: ModelStates, generate_states: ModelStates | None = None,
               forward_openai: ForwardOpenAI | None = None, describe: DescribeModel | None = None,
               unchecked: Unchecked | None = None, pooling_states: ModelStates | None = None,
               forward_pooling: ForwardPooling | None = None,
               adapters: openai_routes.AdapterControl | None = None) -> FastAPI:
    """Health, server metadata, metrics, the OpenAI routes (forwarded to the generate model a
    request names), the pooling routes (to the pooling model it names) and the fallbacks for
    unknown or loading models. Readiness wants every model ready and, with ``unchecked``, every
    port seen answering for each."""
    app = FastAPI(
        title="neuron-serve",
        version=__version__,
        description="Open Inference Protocol v2 (KServe v2 / Triton HTTP) for models compiled by neuron-serve.",
        openapi_url=OPENAPI_PATH,
    )
    install_error_handlers(app)
    auth.install(app)

    async def missing(name: str) -> NeuronServeError:
        state = (await model_states()).get(name)
        if state is None:
            return ModelNotFound(f"model {name!r} not found")
        return ModelNotReady(f"model {name!r} is not ready ({state})")

    @app.get(HEALTH_LIVE)
    async def live() -> dict:
        return {"live": True}

    async def not_ready() -> str | None:
        """Why the server is not ready, or None."""
        states = await model_states()
        waiting = {n: s for n, s in states.items() if s != "ready"}
        if not states or waiting:
            return f"models not ready: {waiting or 'none deployed'}"
        silent = await unchecked(sorted(states)) if unchecked is not None else set()
        if silent:
            return f"models ready, but not every port answers for them yet (HTTP, gRPC, metrics): {sorted(silent)}"
        return None

    @app.get(HEALTH_READY)
    async def ready() -> JSONResponse:
        problem = await not_ready()
        if problem:
            return JSONResponse({"ready": False, "error": problem}, 503)
        return JSONResponse({"ready": True})

    @app.get("/health")  # vLLM's: 200 with an empty body when every model serves (guidellm probes it)
    async def health() -> Response:
        return Response(status_code=503 if await not_ready() else 200)

    @app.get("/v2")
    async def server_metadata() -> dict:
        return {
            "name": "neuron-serve",
            "version": __version__,
            "extensions": triton_ext.EXTENSIONS,
            "emulated": emulated(),
            "models": sorted(await model_states()),
        }

    @app.get("/v2/models/stats")  # before /v2/models/{name}, which would match it too
    async def all_stats() -> JSONResponse:
        return JSONResponse(triton_ext.model_stats(sorted(await model_states())))

    @app.get("/v2/models/{name}")
    async def model_metadata(name: str) -> JSONResponse:
        return _error(await missing(name))

    @app.get("/v2/models/{name}/config")
    @app.get("/v2/models/{name}/stats")
    async def model_extension(name: str) -> JSONResponse:
        return _error(await missing(name))

    @app.get("/v2/models/{name}/ready")
    async def model_ready(name: str) -> JSONResponse:
        return _error(await missing(name))

    @app.post("/v2/models/{name}/infer")
    async def model_infer(name: str) -> JSONResponse:
        return _error(await missing(name))

    @app.post("/v2/models/{name}/generate")
    @app.post("/v2/models/{name}/generate_stream")
    async def model_generate(name: str) -> JSONResponse:
        return _error(await missing(name))

    @app.get(METRICS_PATH)
    async def scrape() -> Response:
        return Response(metrics.scrape(), media_type="text/plain; version=0.0.4")

    if generate_states is not None and forward_openai is not None:
        openai_routes.install(app, model_states, generate_states, forward_openai, describe, pooling_states,
                              adapters)
    if pooling_states is not None and forward_pooling is not None:
        pooling_routes.install(app, model_states, pooling_states, forward_pooling)
    return app
