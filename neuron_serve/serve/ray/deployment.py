"""Ray Serve deployments: the model replicas and the server app, and the applications they make.

Deploying and stopping them is `deploy`. Each model is its own Serve application at ``/v2/models/{name}`` (so requests go
straight to its replicas): an infer model's replicas are here, a generate model's in
`generate_deployment`, a pooling model's in `pooling_deployment`; the ``neuron-serve``
application at ``/`` serves health, server metadata, metrics and the ``/v1`` routes. Replicas ask Ray for ``neuron_cores`` when the cluster
advertises them, so each gets its own cores; in emulation each replica gets
``cores_per_replica`` XLA:CPU devices.
"""

from __future__ import annotations

import asyncio
import logging
import os

import ray
from ray import serve

from ... import logs, metrics
from ...compile.cache import CACHE_ENV
from ...config.pooling import POOLING_TASKS
from ...config.schema import ModelConfig
from ...targets.pjrt import neuron_devices_present
from ...errors import ConfigError
from ..infer.plane import ModelDataPlane
from ..http import auth
from ..infer import plane as dataplane
from . import generate_deployment, pooling_deployment
from .applications import (Adapters, call_model, forward_pooling, generate_states, model_card, model_states,
                           pooling_states, statuses)
from ..grpc import service as grpc_service
from . import grpc_port
from . import cluster, readiness
from .oip_replica import OipReplica
from .replica_base import stop_grpc
from ..http.app import server_app
from ..infer.http import model_app

logger = logging.getLogger("neuron_serve")

SERVER_APP = cluster.SERVER_APP
NEURON_CORES = "neuron_cores"  # the Ray resource each replica asks for on Neuron clusters
# How long a stopping replica waits for the requests it holds (Serve's graceful shutdown).
DRAIN_S = 30
ONGOING_PER_CAPACITY = 8
# How often the server app checks whether it should listen for gRPC (see Server._hand_over).
GRPC_HANDOVER_S = 0.5
GRPC_RECHECK_S = 2.0

_MODEL_API = model_app()


# max_constructor_retry_count=1: building is deterministic (the same model.yaml, the same
# compiler), so a replica that cannot be built fails the deployment at once with its
# error instead of Serve rebuilding it again and again. Replicas that die after the
# deployment has started are still restarted.
@serve.deployment(name="model", graceful_shutdown_timeout_s=DRAIN_S, health_check_period_s=5,
                  max_constructor_retry_count=1)
@serve.ingress(_MODEL_API)
class ModelServer(OipReplica):
    """One replica of one model: builds it on construction, then serves OIP v2.

    This is the serving edge, the one place that builds: the data plane and the
    runtime below it take the built model and never import the compiler.
    """

    async def __init__(self, config: dict, base_dir: str | None, grpc_options: dict | None = None) -> None:
        parsed, replica = await self._build(config, base_dir, _build_plane)
        self._serve(self.plane, replica)
        await self._serve_grpc(grpc_options, parsed.name, replica)

    def _set_current(self, plane: ModelDataPlane | None) -> None:
        dataplane.set_current(plane)


def _build_plane(config: ModelConfig, base_dir: str | None, replica: str) -> ModelDataPlane:
    """The model's data plane, once the start-up models are compiled and loaded; the models still
    compiling join it as each is compiled (all of it on the compile queue's thread)."""
    from ...assembly.from_config import StagedBuild  # noqa: PLC0415 - the compiler is loaded by replicas only
    from ...assembly.rebucket import families  # noqa: PLC0415 - as the build
    from ...buckets.learn import attach  # noqa: PLC0415

    build = StagedBuild(config, base_dir)
    planes: list[ModelDataPlane] = []

    def load(model) -> ModelDataPlane:
        # An artifact loads in one job: the plane counts its compiled models itself.
        planes.append(ModelDataPlane(config, model, replica, compiles=build.compiles if build.path is None else None,
                                     record_sizes=True))
        return planes[0]

    plane = build.start(load, grow=lambda model: planes[0].grow(model))
    attach(plane, config, build.grid, families(plane, config, build))  # none for an artifact (no grid)
    return plane


async def unchecked_models(models: list[str]) -> set[str]:
    """Those of ``models`` whose ports deploy has not yet seen answer (none unless it checks)."""
    return await readiness.unchecked(models) if readiness.checks_ports() else set()


@serve.deployment(name="server", num_replicas=1, ray_actor_options={"num_cpus": 0})
@serve.ingress(server_app(model_states, generate_states, generate_deployment.forward_openai, model_card,
                          unchecked_models, pooling_states, forward_pooling, Adapters()))
class Server:
    """Health, server metadata, metrics and fallbacks, and the gRPC service; holds no model.

    ``ports_checked``: started by ``deploy``, which says when every port answers for each
    model (readiness); readiness waits for it too. A server app built from a Serve config
    (`build_server_app`) has no such deploy.
    """

    async def __init__(self, grpc_options: dict | None = None, ports_checked: bool = False) -> None:
        readiness.check_ports(ports_checked)
        auth.configure(auth.resolve_token(None))
        self._grpc = self._grpc_key = None
        self._grpc_options = grpc_options
        self._watch = None
        if grpc_options and grpc_options.get("front"):
            # Behind HAProxy it answers what no model's replica does: server health and
            # metadata, and calls for models that are not (yet) served.
            self._grpc, _, self._grpc_key = await grpc_port.start_for_replica(grpc_options, model_states, call_model)
        elif grpc_options:
            await self._listen(True)
            self._watch = asyncio.get_running_loop().create_task(self._hand_over())

    async def _listen(self, on: bool) -> None:
        if on and self._grpc is None:
            options = self._grpc_options
            self._grpc, _, _ = await grpc_service.start(options["host"], options["port"],
                                                        options["max_message_bytes"], model_states, call_model)
        elif not on and self._grpc is not None:
            server, self._grpc = self._grpc, None
            await server.stop(grace=5)
        else:
            return
        grpc_port.record_listening(on)  # deploy checks the port only once the models' replicas have it

    async def _hand_over(self) -> None:
        """Listen for gRPC only while no model is ready.

        A ready model's replicas listen on the same port and run its calls themselves;
        a connection that landed here would take an extra hop (a Serve handle call) for
        every call. While models build, or when none is left, this replica answers on
        the port: probes, metadata, and not-found or not-ready for inference.
        """
        while True:
            # Soon while listening (deploy waits for the hand-over before it says ready);
            # seldom after, since serve.status costs this replica CPU each time.
            await asyncio.sleep(GRPC_HANDOVER_S if self._grpc is not None else GRPC_RECHECK_S)
            try:
                # A generate model's replicas serve no gRPC: only a ready infer or pooling model takes the port.
                states, kinds = await statuses()
                await self._listen(not any(state == "ready" and kinds.get(name) != "generate"
                                           for name, state in states.items()))
            except Exception as exc:  # Serve's controller busy or restarting: ask again later
                logger.debug("gRPC hand-over check failed: %s", exc)

    async def __del__(self) -> None:
        if getattr(self, "_watch", None) is not None:
            self._watch.cancel()
        await stop_grpc(self)


def replica_env(config: ModelConfig) -> dict[str, str]:
    env = {metrics.MULTIPROC_ENV: metrics.multiproc_dir()}
    for name in (CACHE_ENV, logs.VERBOSE_ENV):  # `neuron-serve --cache-dir ...` and `-v`
        if os.environ.get(name):
            env[name] = os.environ[name]
    if not neuron_devices_present():
        env.update({"PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": str(config.cores_per_replica)})
    return env


def max_ongoing_requests(config: ModelConfig) -> int:
    """How many requests Ray Serve hands one replica at once.

    Several times what the replica's batcher holds (its queue plus the batches running
    on every core), so that in a burst the batcher answers 503 at once with a JSON error,
    rather than Ray holding requests in its own queue with no deadline. Refused requests
    cost the replica little: it refuses before reading their bodies.
    """
    batching = config.batching
    running = 2 * config.cores_per_replica * batching.max_batch_size
    return ONGOING_PER_CAPACITY * (batching.max_queue_size + running)


def model_application(config: ModelConfig, base_dir: str | None, grpc: dict | None = None):
    """The Serve application of one model, with replica count and resources; its
    replicas serve gRPC too when ``grpc`` says where (see grpc_port.options)."""
    resources = {}
    if ray.cluster_resources().get(NEURON_CORES):
        resources[NEURON_CORES] = config.cores_per_replica
    env = {**replica_env(config), **auth.token_env_vars(config, auth.resolve_token(config))}
    options = {"ray_actor_options": {"num_cpus": 0, "resources": resources, "runtime_env": {"env_vars": env}}}
    if config.autoscaling is not None:
        options["autoscaling_config"] = config.autoscaling.model_dump()
    else:
        options["num_replicas"] = config.replicas
    if config.task == "generate":
        return generate_deployment.application(config, base_dir, options)
    options["max_ongoing_requests"] = max_ongoing_requests(config)
    if config.task in POOLING_TASKS:
        return pooling_deployment.PoolingServer.options(**options).bind(config.model_dump(), base_dir, grpc)
    return ModelServer.options(**options).bind(config.model_dump(), base_dir, grpc)


def server_application(configs: list[ModelConfig], grpc: dict | None = None, ports_checked: bool = False):
    """The server app, requiring the models' token when any of them has one (``ports_checked``:
    deploy's, whose readiness waits for deploy to see every port answer; see Server)."""
    tokens = {t for t in (auth.resolve_token(c) for c in configs) if t is not None}
    if len(tokens) > 1:
        raise ConfigError("http.auth: models served together must use the same token; "
                          "point their token_env or token_file at one secret.")
    env = {metrics.MULTIPROC_ENV: metrics.multiproc_dir()}
    env.update(auth.token_env_vars(None, tokens.pop()) if tokens else {})
    return Server.options(ray_actor_options={"num_cpus": 0, "runtime_env": {"env_vars": env}}).bind(grpc, ports_checked)


# Builders for Serve config files (KubeRay RayService `import_path`s), which run the
# same applications `neuron-serve deploy` runs.


def build_model_app(args: dict):
    """``neuron_serve.serve.ray.deployment:build_model_app`` with ``{"config": "model.yaml"}``."""
    from ...config.schema import load_deployment  # noqa: PLC0415

    return model_application(*load_deployment(args["config"]))


def build_server_app(args: dict | None = None):
    """``neuron_serve.serve.ray.deployment:build_server_app``: health, metadata, metrics.

    ``{"configs": ["a/model.yaml", ...]}`` names the models served beside it, whose
    bearer token the server app then requires too (as `neuron-serve deploy` does).
    """
    from ...config.schema import load_deployment  # noqa: PLC0415

    return server_application([load_deployment(path)[0] for path in (args or {}).get("configs", [])])
