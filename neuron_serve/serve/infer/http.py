"""The routes under ``/v2/models/{name}`` of an infer model, served by the replica's current data plane."""

from __future__ import annotations

from collections.abc import Mapping

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response
from starlette.requests import Request
from starlette.routing import Route

from ..http.base import model_base_app, read_body
from ..protocols import oip_rest
from . import plane as dataplane, triton as triton_ext


async def infer(plane: dataplane.ModelDataPlane, body: bytes,
                headers: Mapping[str, str]) -> tuple[bytes, dict[str, str]]:
    """One OIP v2 REST infer request (JSON, or JSON and binary tensors) on ``plane``: (body, headers).

    Decoded with the codec (`oip_rest`), run by the plane, the answer encoded with the
    codec, inside the request's `InferCall` (the codec's work timed and counted with it).
    """
    with plane.begin() as call:
        request = oip_rest.parse_infer_request(body, headers, max_elements=plane.max_elements, model=plane.name)
        return oip_rest.encode_response(await plane.infer(request, call))


def model_app() -> FastAPI:
    """Routes under /v2/models/{name} of an infer model, served by the replica's current data plane."""
    app, plane = model_base_app("neuron-serve model", dataplane.current)

    @app.get("/config")
    async def config() -> JSONResponse:
        return JSONResponse(plane().triton_config())

    @app.get("/stats")
    async def stats() -> JSONResponse:
        return JSONResponse(triton_ext.model_stats([plane().name]))

    async def infer_route(request: Request) -> Response:
        served = plane()
        served.admit()  # refuse before reading the body when the queue is full
        body = await read_body(request, served.config.http.max_request_bytes)
        content, headers = await infer(served, body, request.headers)
        return Response(content, headers=headers)

    # A plain Starlette route: the hot path needs none of FastAPI's parameter solving
    # (the route alone takes 13 µs a request instead of 27). Errors still go through the
    # app's handlers.
    app.router.routes.append(Route("/infer", infer_route, methods=["POST"]))
    return app
