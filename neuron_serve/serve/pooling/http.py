"""HTTP routes of a pooling model (task: embed, score, classify), mounted at ``/v2/models/{name}``.

OIP v2 as for an infer model (metadata with the pooling settings, readiness, Triton's
configuration and statistics, ``/infer`` on the compiled model's tensors), and the pooling
routes under the model's own base URL, as a generate model's OpenAI routes are
(``/v2/models/{name}/v1/embeddings`` and so on); the server app's ``/v1`` routes forward to
the same answers. An OpenAI client works with either base URL.
"""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response
from starlette.requests import Request
from starlette.routing import Route

from ..http.base import model_base_app, read_body
from ..infer import triton as triton_ext
from ..infer.http import infer
from ..protocols import openai
from ..protocols.openai_pooling import ROUTES
from . import plane as pooling_plane
from .answers import answer, error


def pooling_app() -> FastAPI:
    """Routes under /v2/models/{name} of a pooling model, served by the replica's current pooling plane."""
    app, plane = model_base_app("neuron-serve pooling model", pooling_plane.current)

    @app.get("/config")
    async def config() -> JSONResponse:
        return JSONResponse(plane().data.triton_config())

    @app.get("/stats")
    async def stats() -> JSONResponse:
        return JSONResponse(triton_ext.model_stats([plane().name]))

    async def infer_route(request: Request) -> Response:
        served = plane().data
        served.admit()
        body = await read_body(request, served.config.http.max_request_bytes)
        content, headers = await infer(served, body, request.headers)
        return Response(content, headers=headers)

    def pooling_route(route: str):
        async def endpoint(request: Request) -> Response:
            try:
                served = plane()
                served.admit()  # refuse before reading the body when the queue is full
                body = await read_body(request, served.config.http.max_request_bytes)
            except Exception as exc:  # noqa: BLE001 - not ready, overloaded, too large: OpenAI's error object
                found = error(exc)
            else:
                found = await answer(served, route, body)
            return Response(found.body, status_code=found.status, headers=found.headers)
        return endpoint

    async def models(_: Request) -> Response:
        served = plane()
        return JSONResponse(openai.models_list([served.name], {served.name: served.model_card()}))

    async def model(request: Request) -> Response:
        served, asked = plane(), request.path_params["model_id"]
        if asked != served.name:
            found = error(openai.unknown_model(asked, [served.name]))
            return Response(found.body, status_code=found.status, headers=found.headers)
        return JSONResponse(openai.model_card(served.name, served.model_card()))

    app.router.routes.append(Route("/infer", infer_route, methods=["POST"]))
    for route in ROUTES:
        app.router.routes.append(Route(route, pooling_route(route), methods=["POST"]))
    app.router.routes.append(Route("/v1/models", models, methods=["GET"]))
    app.router.routes.append(Route("/v1/models/{model_id:path}", model, methods=["GET"]))
    return app

