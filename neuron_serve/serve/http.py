"""HTTP routes of the Open Inference Protocol v2, as FastAPI apps.

Two apps: the model app (one per model, mounted at ``/v2/models/{name}``) serves
metadata, readiness and inference from its ModelDataPlane; the server app (mounted at
``/``) serves health, server metadata, ``/metrics``, the OpenAPI document, and answers
for models that are unknown (404) or still loading (503). Errors are always
``{"error": "..."}`` with the status of the error's type (see neuron_serve.errors).
"""

from __future__ import annotations

from typing import Any, Awaitable, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.routing import Route

from .. import metrics
from ..version import __version__
from ..errors import ModelNotFound, ModelNotReady, NeuronServeError, PayloadTooLarge
from ..targets.pjrt import emulated
from ..config import DEFAULT_MAX_REQUEST_BYTES
from . import auth, dataplane, openai_routes, triton_ext

OPENAPI_PATH = "/openapi.json"
HEALTH_LIVE = "/v2/health/live"
HEALTH_READY = "/v2/health/ready"
METRICS_PATH = "/metrics"


def _error(exc: NeuronServeError) -> JSONResponse:
    return JSONResponse({"error": str(exc)}, status_code=exc.http_status)


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(NeuronServeError)
    async def _typed(_: Request, exc: NeuronServeError) -> JSONResponse:
        return _error(exc)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        # A fault of the server or the model, not of the request: still a JSON error.
        return JSONResponse({"error": f"internal error: {type(exc).__name__}: {exc}"}, status_code=500)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse({"error": str(exc)}, status_code=400)


async def read_body(request: Request, limit: int = DEFAULT_MAX_REQUEST_BYTES) -> bytes:
    """The request body, refused with 413 as soon as it passes ``limit`` bytes."""
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(f"request body of {declared} bytes exceeds the limit of {limit} bytes")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise PayloadTooLarge(f"request body exceeds the limit of {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def model_base_app(title: str, current: Callable[[], Any]) -> tuple[FastAPI, Callable[[], Any]]:
    """A model's app with its error handlers, auth, metadata (``""``) and readiness (``/ready``),
    and the function that returns the replica's plane (``current()``) or raises ModelNotReady.

    Ray Serve ships the app to each replica by value, so ``current`` is a module function
    (found by name in the replica), not a closure over a plane.
    """
    app = FastAPI(title=title, openapi_url=None, docs_url=None, redoc_url=None)
    _install_error_handlers(app)
    auth.install(app)

    def plane() -> Any:
        found = current()
        if found is None or not found.ready():
            raise ModelNotReady("model is loading or shutting down")
        return found

    @app.get("")
    @app.get("/")
    async def metadata() -> JSONResponse:
        return JSONResponse(plane().metadata())

    @app.get("/ready")
    async def ready() -> JSONResponse:
        return JSONResponse({"name": plane().name, "ready": True})

    return app, plane


def model_app() -> FastAPI:
    """Routes under /v2/models/{name} of an infer model, served by the replica's current data plane."""
    app, plane = model_base_app("neuron-serve model", dataplane.current)

    @app.get("/config")
    async def config() -> JSONResponse:
        return JSONResponse(plane().triton_config())

    @app.get("/stats")
    async def stats() -> JSONResponse:
        return JSONResponse(triton_ext.model_stats([plane().name]))

    async def infer(request: Request) -> Response:
        served = plane()
        served.batcher.admit()  # refuse before reading the body when the queue is full
        body = await read_body(request, served.config.http.max_request_bytes)
        content, headers = await served.infer(body, request.headers)
        return Response(content, headers=headers)

    # A plain Starlette route: the hot path needs none of FastAPI's parameter solving
    # (the route alone takes 13 µs a request instead of 27). Errors still go through the
    # app's handlers.
    app.router.routes.append(Route("/infer", infer, methods=["POST"]))
    return app


ModelStates = Callable[[], Awaitable[dict[str, str]]]  # model name -> "ready" | "loading" | "failed: ..."
# (model, "completions" | "chat", body) -> a Serve response generator: (status, headers, streamed), then bytes
ForwardOpenAI = Callable[[str, str, bytes], Awaitable[Any]]
# model -> what GET /v1/models says of it beyond its id (max_model_len, tensor_parallel_size)
DescribeModel = Callable[[str], Awaitable[dict]]


def server_app(model_states: ModelStates, generate_states: ModelStates | None = None,
               forward_openai: ForwardOpenAI | None = None, describe: DescribeModel | None = None) -> FastAPI:
    """Health, server metadata, metrics, the OpenAI routes (forwarded to the generate model a
    request names) and the fallbacks for unknown or loading models."""
    app = FastAPI(
        title="neuron-serve",
        version=__version__,
        description="Open Inference Protocol v2 (KServe v2 / Triton HTTP) for models compiled by neuron-serve.",
        openapi_url=OPENAPI_PATH,
    )
    _install_error_handlers(app)
    auth.install(app)

    async def missing(name: str) -> NeuronServeError:
        state = (await model_states()).get(name)
        if state is None:
            return ModelNotFound(f"model {name!r} not found")
        return ModelNotReady(f"model {name!r} is not ready ({state})")

    @app.get(HEALTH_LIVE)
    async def live() -> dict:
        return {"live": True}

    @app.get(HEALTH_READY)
    async def ready() -> JSONResponse:
        states = await model_states()
        waiting = {n: s for n, s in states.items() if s != "ready"}
        if not states or waiting:
            return JSONResponse({"ready": False, "error": f"models not ready: {waiting or 'none deployed'}"}, 503)
        return JSONResponse({"ready": True})

    @app.get("/health")  # vLLM's: 200 with an empty body when every model serves (guidellm probes it)
    async def health() -> Response:
        states = await model_states()
        return Response(status_code=200 if states and all(s == "ready" for s in states.values()) else 503)

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
        openai_routes.install(app, model_states, generate_states, forward_openai, describe)
    return app
