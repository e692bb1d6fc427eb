"""Plain Ray Serve: one replica per model calling the eager model, no batching.

    python -m bench.peers.ray_app --port 18200            # the default HTTP proxy
    python -m bench.peers.ray_app --port 18200 --haproxy  # HAProxy + direct ingress

``--haproxy`` sets RAY_SERVE_ENABLE_HA_PROXY=1 and RAY_SERVE_THROUGHPUT_OPTIMIZED=1
before Ray starts (Ray reads them at import): HAProxy listens on the HTTP port and
forwards straight to the replicas' own HTTP servers (direct ingress), so no Python
proxy actor sits on the request path.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading

from neuron_serve.serve.ports import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def configure_ingress(port: int, haproxy: bool) -> None:
    """Choose Serve's ingress; call before Ray is imported (it reads these at import)."""
    if haproxy:
        os.environ["RAY_SERVE_ENABLE_HA_PROXY"] = "1"
        os.environ["RAY_SERVE_THROUGHPUT_OPTIMIZED"] = "1"
        # HAProxy's stats and metrics frontends default to fixed ports (8404, 9101);
        # free ones let it run beside another HAProxy-fronted Serve (neuron-serve).
        for name in ("RAY_SERVE_HAPROXY_STATS_PORT", "RAY_SERVE_HAPROXY_METRICS_PORT"):
            os.environ.setdefault(name, str(free_port()))
    os.environ.setdefault("RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT", str(port + 10))
    # neuron-serve's deploy starts Ray workers at niceness 0 rather than Ray's 15; the Ray
    # peers get the same, so a busy host slows every server alike and the ratios compare runtimes.
    os.environ.setdefault("RAY_worker_niceness", "0")


def serve_models(deployment, port: int, env_vars: dict[str, str]) -> None:
    """Serve ``deployment`` as the mlp and encoder apps on ``port`` until SIGINT or SIGTERM."""
    import ray  # noqa: PLC0415
    from ray import serve  # noqa: PLC0415

    ray.init(include_dashboard=False, logging_level="WARNING", runtime_env={"env_vars": env_vars})
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    for name in ("mlp", "encoder"):
        serve.run(deployment.options(name=name).bind(name), name=name, route_prefix=f"/v2/models/{name}/infer")
    print("ready", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    serve.shutdown()
    ray.shutdown()
    sys.exit(0)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, default=18200)
    parser.add_argument("--haproxy", action="store_true")
    args = parser.parse_args()
    configure_ingress(args.port, args.haproxy)

    from ray import serve  # noqa: PLC0415
    from starlette.requests import Request  # noqa: PLC0415
    from starlette.responses import Response  # noqa: PLC0415

    @serve.deployment(num_replicas=1, ray_actor_options={"num_cpus": 0})
    class Model:
        def __init__(self, name: str) -> None:
            from bench.peers.models import EagerModels  # noqa: PLC0415

            self.name = name
            self.models = EagerModels()

        async def __call__(self, request: Request) -> Response:
            from bench.peers import codec  # noqa: PLC0415

            inputs, wanted, binary = codec.decode(await request.body(), request.headers)
            body, headers = codec.encode(self.name, self.models.run(self.name, inputs), wanted, binary)
            return Response(body, headers=headers)

    serve_models(Model, args.port, {"PYTHONPATH": ROOT})


if __name__ == "__main__":
    main()
