"""The server app's OpenAI routes at ``/v1``: decode a request once, find the model it names, forward it.

``/v1/completions`` and ``/v1/chat/completions`` decode and check the body here (the
JSON once; a model that is not served is a 404 naming the served ones, as OpenAI
answers, before its other fields are looked at); a replica of that generate model runs
the decoded request and encodes its answer (``serve/generate/answers.py``), whose bytes
are relayed as they come. A client that leaves cancels the call, which aborts its
sequences on the replica.
"""

from __future__ import annotations

import asyncio

from typing import Any, AsyncIterator, Awaitable, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from .base import read_body
from .disconnect import ClientGone, unless_disconnected
from ..protocols import openai

States = Callable[[], Awaitable[dict[str, str]]]


def _error(exc: openai.OpenAIError) -> JSONResponse:
    status, body = openai.error_of(exc)
    headers = {"retry-after": "1"} if status in (429, 503) else None
    return JSONResponse(body, status_code=status, headers=headers)


def requested_model(data: dict) -> str:
    """The ``model`` of a decoded OpenAI request body."""
    if "model" not in data:
        raise openai.OpenAIError("model: Field required (the name of a served model; GET /v1/models lists them)",
                                 param="model")
    if not isinstance(data["model"], str):
        raise openai.OpenAIError("model: Input should be a valid string", param="model")
    return data["model"]


async def _relay(rest: Any) -> AsyncIterator[bytes]:
    try:
        async for chunk in rest:
            yield chunk
    finally:  # the client left (or the stream ended): a running call is cancelled, its sequences aborted
        rest.cancel()


def install(app: FastAPI, model_states: States, generate_states: States,
            forward: Callable[[str, str, Any], Awaitable[Any]],
            describe: Callable[[str], Awaitable[dict]] | None = None, pooling_states: States | None = None) -> None:
    """Add ``GET /v1/models`` and the two generation routes to the server app; ``describe(name)`` gives a
    model's fields beyond its id. The models listed are the generate and the pooling ones (``pooling_states``),
    those OpenAI's API serves."""

    async def listed() -> dict[str, str]:
        return {**(await generate_states()), **(await pooling_states() if pooling_states is not None else {})}

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        states = await listed()
        names = sorted(n for n, s in states.items() if s == "ready")
        details = dict(zip(names, await asyncio.gather(*(describe(n) for n in names)))) if describe else None
        return JSONResponse(openai.models_list(names, details))

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> JSONResponse:
        states = await listed()
        if states.get(model_id) != "ready":
            return _error(openai.unknown_model(model_id, sorted(n for n, s in states.items() if s == "ready")))
        return JSONResponse(openai.model_card(model_id, await describe(model_id) if describe else None))

    async def answer(request: Request, kind: str) -> Response:
        try:
            data = openai.json_object(await read_body(request))
            name = requested_model(data)
            states = await generate_states()
            if name not in states:
                error = openai.unknown_model(name, sorted(states))
                if pooling_states is not None and name in await pooling_states():
                    error = openai.OpenAIError(f"{error} ({name!r} is a pooling model, task embed, score or classify: "
                                               f"POST /v1/embeddings, /v1/rerank, /v1/score or /classify)", 404,
                                               "model", "model_not_found")
                elif name in await model_states():
                    error = openai.OpenAIError(f"{error} ({name!r} is a task: infer model: POST "
                                               f"/v2/models/{name}/infer)", 404, "model", "model_not_found")
                raise error
            if states[name] != "ready":
                raise openai.OpenAIError(f"model {name!r} is not ready ({states[name]})", 503)
            decoded = openai.validate(kind, data)
        except openai.OpenAIError as exc:
            return _error(exc)
        except Exception as exc:  # noqa: BLE001 - 413 and the like, as OpenAI error objects
            status, error = openai.error_of(exc)
            return JSONResponse(error, status_code=status)
        call = await forward(name, kind, decoded)
        try:
            status, headers, streamed = await unless_disconnected(request, call.__anext__())
            if not streamed:
                content = await unless_disconnected(request, call.__anext__())
                return Response(content, status_code=status, headers=headers)
        except ClientGone:
            call.cancel()
            return Response(status_code=499)
        except Exception as exc:  # noqa: BLE001 - the replica went away mid-call (stopped, crashed)
            return _error(openai.OpenAIError(f"model {name!r} is not available: {type(exc).__name__}: {exc}; retry",
                                             503))
        return StreamingResponse(_relay(call), status_code=status, headers=headers)

    async def completions(request: Request) -> Response:
        return await answer(request, "completions")

    async def chat(request: Request) -> Response:
        return await answer(request, "chat")

    app.add_api_route("/v1/completions", completions, methods=["POST"], include_in_schema=False)
    app.add_api_route("/v1/chat/completions", chat, methods=["POST"], include_in_schema=False)
