"""What the server app's forwarding routes share (OpenAI's in openai_routes.py, the pooling ones in
pooling_routes.py): the model a request names, looked up among the models of the route's task, and the
OpenAI error object a refusal is answered with."""

from __future__ import annotations

from typing import Awaitable, Callable, Sequence

from fastapi.responses import JSONResponse

from ..protocols import openai

States = Callable[[], Awaitable[dict[str, str]]]


def error_response(exc: Exception) -> JSONResponse:
    """OpenAI's error object for ``exc``, with its status; ``retry-after: 1`` on 429 and 503."""
    status, body = openai.error_of(exc)
    headers = {"retry-after": "1"} if status in (429, 503) else None
    return JSONResponse(body, status_code=status, headers=headers)


def unavailable(name: str, exc: Exception) -> JSONResponse:
    """503 for a call to model ``name`` whose replica went away mid-call (stopped, crashed) with ``exc``."""
    return error_response(openai.OpenAIError(f"model {name!r} is not available: {type(exc).__name__}: {exc}; retry",
                                             503))


async def check_ready(name: str, states: dict[str, str], served: list[str],
                      elsewhere: Sequence[tuple[States | None, str]] = ()) -> None:
    """Raise unless model ``name`` is ready among ``states`` (the models of the route's task): OpenAI's 404 naming
    ``served``, with the hint of the first of ``elsewhere`` (another task's states, and the hint) that holds the
    model; 503 while it is not ready."""
    if name not in states:
        error = openai.unknown_model(name, served)
        for other, hint in elsewhere:
            if other is not None and name in await other():
                raise openai.OpenAIError(f"{error} ({hint})", 404, "model", "model_not_found")
        raise error
    if states[name] != "ready":
        raise openai.OpenAIError(f"model {name!r} is not ready ({states[name]})", 503)
