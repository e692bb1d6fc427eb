"""HTTP routes of a ``task: generate`` model, mounted at ``/v2/models/{name}``.

OIP v2 metadata and readiness, the OIP generate extension (``/generate``,
``/generate_stream``) and the OpenAI routes under the model's own base URL
(``/v2/models/{name}/v1``); the server app's ``/v1`` forwards to the same answers. A
client that disconnects, streamed or not, aborts its sequences at once.
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ..errors import ModelNotReady
from . import auth, generate_plane
from .disconnect import ClientGone, unless_disconnected
from .generate_answers import Answer, infer_refused, openai_answer, generate_answer, openai_error
from .generate_plane import GenerationPlane
from .http import _install_error_handlers, read_body
from .protocols import openai


def to_response(answer: Answer) -> Response:
    """A Starlette response; a stream is sent as it comes (and stopped if the client leaves)."""
    if answer.streamed:
        return StreamingResponse(answer.body, status_code=answer.status, headers=answer.headers)
    return Response(answer.body, status_code=answer.status, headers=answer.headers)


def generate_app() -> FastAPI:
    """Routes under /v2/models/{name} of a generate model, served by the replica's GenerationPlane."""
    app = FastAPI(title="neuron-serve generate model", openapi_url=None, docs_url=None, redoc_url=None)
    _install_error_handlers(app)
    auth.install(app)

    def plane() -> GenerationPlane:
        found = generate_plane.current()
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

    async def answer(request: Request, work) -> Response:
        served = generate_plane.current()
        limit = served.config.http.max_request_bytes if served is not None else None
        body = await (read_body(request, limit) if limit else read_body(request))
        try:
            result = await unless_disconnected(request, work(body))
        except ClientGone:
            return Response(status_code=499)  # nobody reads it; the sequences are aborted
        return to_response(result)

    async def generate(request: Request) -> Response:
        return await answer(request, lambda body: generate_answer(plane(), body, stream=False))

    async def generate_stream(request: Request) -> Response:
        return await answer(request, lambda body: generate_answer(plane(), body, stream=True))

    async def completions(request: Request) -> Response:
        return await answer(request, lambda body: _openai(plane, "completions", body))

    async def chat(request: Request) -> Response:
        return await answer(request, lambda body: _openai(plane, "chat", body))

    async def models(_: Request) -> Response:
        return JSONResponse(openai.models_list([plane().name]))

    async def infer(_: Request) -> Response:
        return to_response(infer_refused(plane().name))

    for path, endpoint, methods in (("/generate", generate, ["POST"]), ("/generate_stream", generate_stream, ["POST"]),
                                    ("/v1/completions", completions, ["POST"]), ("/v1/chat/completions", chat, ["POST"]),
                                    ("/v1/models", models, ["GET"]), ("/infer", infer, ["POST"])):
        app.router.routes.append(Route(path, endpoint, methods=methods))
    return app


async def _openai(plane, kind: str, body: bytes) -> Answer:
    try:
        served = plane()
    except ModelNotReady as exc:
        return openai_error(exc)
    return await openai_answer(served, kind, body)
