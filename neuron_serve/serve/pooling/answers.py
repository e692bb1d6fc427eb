"""A pooling model's answer to one request of a pooling route, decoded and encoded by the route's codec.

Shared by the model's own routes (`http.py`, under ``/v2/models/{name}``) and the server
app's ``/v1`` routes, which forward a request's body to a replica of the model its ``model``
names. Every error is OpenAI's error object, with the field at fault as ``param``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from ..protocols import openai, openai_pooling
from ..protocols.openai_pooling import ROUTES, TASKS
from .plane import PoolingPlane

JSON = {"content-type": "application/json"}


@dataclass
class Answer:
    """An HTTP answer: its status, JSON body and headers."""

    status: int
    body: bytes
    headers: dict[str, str] = field(default_factory=lambda: dict(JSON))


def routes_of(task: str) -> list[str]:
    """The pooling routes a model of ``task`` answers."""
    return [route for route, api in ROUTES.items() if task in TASKS[api]]


def error(exc: Exception) -> Answer:
    """``exc`` as OpenAI's error object (503 and 429 with Retry-After)."""
    status, body = openai.error_of(exc)
    headers = {**JSON, "retry-after": "1"} if status in (429, 503) else dict(JSON)
    return Answer(status, json.dumps(body).encode(), headers)


def _check_model(plane: PoolingPlane, api: str, asked: str | None) -> None:
    if asked is not None and asked != plane.name:
        raise openai.unknown_model(asked, [plane.name])
    if plane.spec.task not in TASKS[api]:
        route = next(r for r, a in ROUTES.items() if a == api)
        needs = " or ".join(f"task: {t}" for t in TASKS[api])
        raise openai.OpenAIError(f"model {plane.name!r} is a task: {plane.spec.task} model, which answers "
                                 f"{', '.join(routes_of(plane.spec.task))}; {route} needs a {needs} model",
                                 param="model")


async def answer(plane: PoolingPlane, route: str, body: bytes) -> Answer:
    """The answer of ``plane`` to ``body`` sent to pooling route ``route`` (a key of ROUTES)."""
    api = ROUTES[route]
    inputs = tokens = padded = 0
    try:
        plane.admit()  # a full queue refuses before anything is decoded
        with plane.data.begin() as call:  # counted and timed as an infer request, the codec's work included
            parsed = openai_pooling.parse(api, body)
            _check_model(plane, api, parsed.model)
            request = openai_pooling.decode(parsed)
            result = await plane.pool(request, call)
            content = openai_pooling.encode(parsed, result, plane.name, plane.spec.labels)
        inputs, tokens, padded = request.count, result.tokens, result.padded
        found = Answer(200, content)
    except Exception as exc:  # noqa: BLE001 - every failure is answered as an error object
        found = error(exc)
    plane.metrics.answered(api, found.status, inputs, tokens, padded)
    return found
