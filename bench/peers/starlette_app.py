"""Single-process uvicorn + Starlette calling the eager models directly: the Python HTTP ceiling.

    python -m bench.peers.starlette_app --port 18100
"""

from __future__ import annotations

import argparse

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from . import codec
from .models import EagerModels


def build_app() -> Starlette:
    models = EagerModels()

    async def infer(request: Request) -> Response:
        name = request.path_params["name"]
        inputs, wanted, binary = codec.decode(await request.body(), request.headers)
        # Called on the event loop on purpose: one process, no thread hand-off.
        body, headers = codec.encode(name, models.run(name, inputs), wanted, binary)
        return Response(body, headers=headers)

    async def ready(_: Request) -> Response:
        return JSONResponse({"ready": True})

    return Starlette(routes=[
        Route("/v2/models/{name}/infer", infer, methods=["POST"]),
        Route("/v2/health/ready", ready),
    ])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, default=18100)
    args = parser.parse_args()
    uvicorn.run(build_app(), host="127.0.0.1", port=args.port, log_level="warning", access_log=False)


if __name__ == "__main__":
    main()
