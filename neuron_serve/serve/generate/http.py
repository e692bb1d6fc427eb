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

from ...errors import ModelNotReady
from . import plane as generate_plane
from ..http.disconnect import ClientGone, unless_disconnected
from .answers import Answer, infer_refused, openai_answer, generate_answer, openai_error
from .plane import GenerationPlane
from ..http.base import model_base_app, read_body
from ..protocols import openai


def to_response(answer: Answer) -> Response:
    """A Starlette response; a stream is sent as it comes (and stopped if the client leaves)."""
    if answer.streamed:
        return StreamingResponse(answer.body, status_code=answer.status, headers=answer.headers)
    return Response(answer.body, status_code=answer.status, headers=answer.headers)


async def _openai(plane: GenerationPlane, kind: str, body: bytes) -> Answer:
    """An OpenAI request to the model's own base URL: decoded here, once."""
    try:
        request = openai.parse(kind, body)
    except openai.OpenAIError as exc:
        answer = openai_error(exc)
        plane.record(answer.status, 0.0)
        return answer
    return await openai_answer(plane, kind, request)


def generate_app() -> FastAPI:
    """Routes under /v2/models/{name} of a generate model, served by the replica's GenerationPlane."""
    app, plane = model_base_app("neuron-serve generate model", generate_plane.current)

    async def answer(request: Request, work, openai_errors: bool = False) -> Response:
        try:
            served: GenerationPlane = plane()
        except ModelNotReady as exc:
            if not openai_errors:
                raise
            return to_response(openai_error(exc))
        body = await read_body(request, served.config.http.max_request_bytes)
        try:
            result = await unless_disconnected(request, work(served, body))
        except ClientGone:
            return Response(status_code=499)  # nobody reads it; the sequences are aborted
        return to_response(result)

    async def generate(request: Request) -> Response:
        return await answer(request, lambda served, body: generate_answer(served, body, stream=False))

    async def generate_stream(request: Request) -> Response:
        return await answer(request, lambda served, body: generate_answer(served, body, stream=True))

    async def completions(request: Request) -> Response:
        return await answer(request, lambda served, body: _openai(served, "completions", body), True)

    async def chat(request: Request) -> Response:
        return await answer(request, lambda served, body: _openai(served, "chat", body), True)

    async def models(_: Request) -> Response:
        served = plane()
        cards = {served.name: served.model_card(), **await served.adapter_cards()}
        return JSONResponse(openai.models_list(list(cards), cards))

    async def model(request: Request) -> Response:
        served, asked = plane(), request.path_params["model_id"]
        cards = {served.name: served.model_card(), **await served.adapter_cards()}
        if asked not in cards:
            return to_response(openai_error(openai.unknown_model(asked, list(cards))))
        return JSONResponse(openai.model_card(asked, cards[asked]))

    async def infer(_: Request) -> Response:
        return to_response(infer_refused(plane().name))

    for path, endpoint, methods in (("/generate", generate, ["POST"]), ("/generate_stream", generate_stream, ["POST"]),
                                    ("/v1/completions", completions, ["POST"]), ("/v1/chat/completions", chat, ["POST"]),
                                    ("/v1/models", models, ["GET"]), ("/v1/models/{model_id:path}", model, ["GET"]),
                                    ("/infer", infer, ["POST"])):
        app.router.routes.append(Route(path, endpoint, methods=methods))
    return app
