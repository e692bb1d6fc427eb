"""The server app's pooling routes (``/v1/embeddings``, ``/v1/rerank``, ``/v2/rerank``, ``/v1/score``,
``/classify`` and vLLM's other spellings): find the model a request names and forward to it.

Only the body's ``model`` is read here; a replica of that pooling model decodes, runs and
encodes the request (`serve.pooling.answers`), and its answer is relayed as it is. A model
that is not served is a 404 naming the served pooling models, as OpenAI answers; a rerank,
score or classify request without ``model`` goes to the one pooling model when there is
one (Jina's and vLLM's ``model`` is optional).
"""

from __future__ import annotations

from typing import Awaitable, Callable

from fastapi import FastAPI, Request
from fastapi.responses import Response

from .base import read_body
from .model_lookup import States, check_ready, error_response, unavailable
from ..protocols import openai
from ..protocols.openai_pooling import ROUTES

Forward = Callable[[str, str, bytes], Awaitable[tuple[int, dict, bytes]]]


def _model(body: bytes, route: str, served: list[str]) -> str:
    """The pooling model a request is for: its ``model``, else the only one served (not for OpenAI's embeddings)."""
    data = openai.json_object(body)
    name = data.get("model")
    if name is None:
        if route != "/v1/embeddings" and len(served) == 1:
            return served[0]
        raise openai.OpenAIError(f"model: Field required (the name of a served model: "
                                 f"{', '.join(served) or 'none is served'})", param="model")
    if not isinstance(name, str):
        raise openai.OpenAIError("model: Input should be a valid string", param="model")
    return name


def install(app: FastAPI, model_states: States, pooling_states: States, forward: Forward) -> None:
    """Add every pooling route to the server app, each forwarded to the pooling model its request names."""

    def route_for(route: str):
        async def endpoint(request: Request) -> Response:
            try:
                body = await read_body(request)
                states = await pooling_states()
                name = _model(body, route, sorted(n for n, s in states.items() if s == "ready"))
                await check_ready(name, states, sorted(states), (
                    (model_states, f"{name!r} is not a pooling model: task embed, score or classify"),))
            except Exception as exc:  # noqa: BLE001 - 400, 404, 413 and the like, as OpenAI error objects
                return error_response(exc)
            try:
                status, headers, content = await forward(name, route, body)
            except Exception as exc:  # noqa: BLE001 - the replica went away mid-call (stopped, crashed)
                return unavailable(name, exc)
            return Response(content, status_code=status, headers=headers)
        return endpoint

    for route in ROUTES:
        app.add_api_route(route, route_for(route), methods=["POST"], include_in_schema=False)
