"""What every neuron-serve HTTP app shares: JSON errors, body reading with its limit, and a
model's base app (auth, metadata, readiness) that the infer and generate planes extend.

Errors are always ``{"error": "..."}`` with the status of the error's type (see
neuron_serve.errors).
"""

from __future__ import annotations

from typing import Any, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from ...errors import ModelNotReady, NeuronServeError, PayloadTooLarge
from ...config.schema import DEFAULT_MAX_REQUEST_BYTES
from . import auth


def error(exc: NeuronServeError) -> JSONResponse:
    return JSONResponse({"error": str(exc)}, status_code=exc.http_status)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(NeuronServeError)
    async def _typed(_: Request, exc: NeuronServeError) -> JSONResponse:
        return error(exc)

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
    install_error_handlers(app)
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
