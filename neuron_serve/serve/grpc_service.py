"""OIP v2 over gRPC: ``inference.GRPCInferenceService`` of KServe and Triton.

Every model replica runs one gRPC server beside its HTTP one, all on one port
(SO_REUSEPORT): a call for the replica's own model runs on its data plane in the
process that received it, with no hop. KServe's and Triton's clients name the model
inside each message (``model_name``), not in call metadata, so Ray Serve's gRPC proxy,
which routes by an ``application`` metadata key, cannot route them unchanged; a call
for another model is forwarded to that model's replicas through a Serve handle
(``call_model``). The server app listens on the port only while no model is ready (it
answers probes and not-found while models build). The model's data plane runs a call
through the same checks, limits, batcher and statistics as HTTP (the codec is
``protocols/oip_grpc``: protobuf to tensors, no JSON on the way).

Beside it, ``grpc.health.v1.Health`` answers Kubernetes' gRPC probes: service ``live``
(or ``""``) is SERVING while the server runs, ``ready`` (or
``inference.GRPCInferenceService``) once every model is ready.

Errors carry the HTTP answer's message with the matching status code; authentication,
when on, wants ``authorization: Bearer <token>`` metadata on every call but ServerLive
and ServerReady (left open for probes, as the HTTP health routes are).
"""

from __future__ import annotations

import logging
from typing import Any, Awaitable, Callable

import grpc
from google.protobuf import json_format
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tritonclient.grpc import model_config_pb2, service_pb2 as pb, service_pb2_grpc

from .. import __version__
from ..errors import ModelNotFound, ModelNotReady, NeuronServeError
from . import auth, triton_ext
from .protocols import oip_grpc

SERVED_VERSION = "1"  # the one version of each model (dataplane's metadata lists it)

logger = logging.getLogger("neuron_serve")

STATUS_CODES = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    404: grpc.StatusCode.NOT_FOUND,
    413: grpc.StatusCode.RESOURCE_EXHAUSTED,
    503: grpc.StatusCode.UNAVAILABLE,
    504: grpc.StatusCode.DEADLINE_EXCEEDED,
}

ModelStates = Callable[[], Awaitable[dict[str, str]]]
# (model, method, payload) -> ("ok", result) or ("error", http_status, message)
CallModel = Callable[[str, str, bytes], Awaitable[tuple]]


class _Failed(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


async def replica_call(plane: Any, method: str, payload: bytes | pb.ModelInferRequest) -> tuple:
    """Run one gRPC call on a model replica's data plane (``plane`` may be None).

    ``payload`` is the serialized request when the call was forwarded from another
    replica, or the message itself when this replica's own gRPC server received it.
    """
    try:
        if plane is None or not plane.ready():
            raise ModelNotReady("model is loading or shutting down")
        if method == "metadata":
            return ("ok", plane.metadata())
        if method == "config":
            return ("ok", plane.triton_config())
        if method == "infer":
            plane.batcher.admit()  # refuse before decoding when the queue is full
            return ("ok", await infer(plane, payload))
        raise NeuronServeError(f"unknown model call {method!r}")
    except NeuronServeError as exc:
        return ("error", exc.http_status, str(exc))
    except Exception as exc:  # a fault of the server or the model: still an answer with a message
        return ("error", 500, f"internal error: {type(exc).__name__}: {exc}")


async def infer(plane: Any, payload: bytes | pb.ModelInferRequest) -> pb.ModelInferResponse:
    """One ``ModelInferRequest`` (or its bytes) through the plane; the answer.

    The message is decoded into tensors over its own bytes and the answer encoded from
    the output tensors: no other protocol's form is made on the way.
    """
    def decode():
        message = payload if isinstance(payload, pb.ModelInferRequest) else pb.ModelInferRequest.FromString(payload)
        return oip_grpc.decode_request(message, max_elements=plane.max_elements)

    return await plane.handle(decode, oip_grpc.encode_response)


class InferenceServicer(service_pb2_grpc.GRPCInferenceServiceServicer):
    """The gRPC inference service of every model deployed together."""

    def __init__(self, model_states: ModelStates, call_model: CallModel, local: str | None = None) -> None:
        self.model_states = model_states
        self.call_model = call_model
        # The model served by this very process, if any: its calls need no state
        # lookup (its data plane knows whether it is ready) and no forwarding.
        self.local = local

    # -- helpers ---------------------------------------------------------------------

    @staticmethod
    async def _abort(context: grpc.aio.ServicerContext, status: int, message: str) -> None:
        await context.abort(STATUS_CODES.get(status, grpc.StatusCode.INTERNAL), message)

    @staticmethod
    async def _authorize(context: grpc.aio.ServicerContext) -> None:
        token = auth.current_token()
        if token is None:
            return
        header = dict(context.invocation_metadata() or ()).get("authorization")
        if not auth.authorized(header, token):
            problem = "missing Authorization header" if header is None else "invalid bearer token"
            await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                                f"unauthorized: {problem}; send 'authorization: Bearer <token>' metadata")

    @staticmethod
    def _version(name: str, version: str) -> None:
        """Each model serves one version, "1" (as its metadata says); another is refused,
        not ignored. Empty means the served one."""
        if version not in ("", SERVED_VERSION):
            raise _Failed(ModelNotFound.http_status, f"model {name!r} has no version {version!r}: it serves version "
                                                     f"{SERVED_VERSION!r}; set model_version to it, or leave it empty")

    async def _ready_model(self, name: str) -> None:
        state = (await self.model_states()).get(name)
        if state is None:
            raise _Failed(ModelNotFound.http_status, f"model {name!r} not found")
        if state != "ready":
            raise _Failed(ModelNotReady.http_status, f"model {name!r} is not ready ({state})")

    async def _call(self, context, name: str, method: str, payload: Any = b"") -> Any:
        if name != self.local:
            await self._ready_model(name)
        try:
            answer = await self.call_model(name, method, payload)
        except Exception as exc:  # the model's replicas went away mid-call (shutdown, crash)
            raise _Failed(503, f"model {name!r} is not available: {type(exc).__name__}: {exc}") from None
        if answer[0] != "ok":
            raise _Failed(answer[1], answer[2])
        return answer[1]

    async def _guard(self, context, work: Callable[[], Awaitable[Any]], open_: bool = False) -> Any:
        if not open_:
            await self._authorize(context)
        try:
            return await work()
        except _Failed as exc:
            await self._abort(context, exc.status, str(exc))

    # -- the service -----------------------------------------------------------------

    async def ServerLive(self, request, context):
        return pb.ServerLiveResponse(live=True)

    async def ServerReady(self, request, context):
        states = await self.model_states()
        return pb.ServerReadyResponse(ready=bool(states) and all(s == "ready" for s in states.values()))

    async def ModelReady(self, request, context):
        async def work():
            self._version(request.name, request.version)
            state = (await self.model_states()).get(request.name)
            if state is None:
                raise _Failed(404, f"model {request.name!r} not found")
            return pb.ModelReadyResponse(ready=state == "ready")
        return await self._guard(context, work)

    async def ServerMetadata(self, request, context):
        async def work():
            return pb.ServerMetadataResponse(name="neuron-serve", version=__version__,
                                             extensions=triton_ext.EXTENSIONS)
        return await self._guard(context, work)

    async def ModelMetadata(self, request, context):
        async def work():
            self._version(request.name, request.version)
            meta = await self._call(context, request.name, "metadata")
            response = pb.ModelMetadataResponse(name=meta["name"], versions=meta["versions"], platform=meta["platform"])
            for kind in ("inputs", "outputs"):
                for tensor in meta[kind]:
                    getattr(response, kind).add(name=tensor["name"], datatype=tensor["datatype"], shape=tensor["shape"])
            return response
        return await self._guard(context, work)

    async def ModelInfer(self, request, context):
        async def work():
            self._version(request.model_name, request.model_version)
            local = request.model_name == self.local
            answer = await self._call(context, request.model_name, "infer",
                                      request if local else request.SerializeToString())
            return answer if isinstance(answer, pb.ModelInferResponse) else pb.ModelInferResponse.FromString(answer)
        return await self._guard(context, work)

    async def ModelConfig(self, request, context):
        async def work():
            self._version(request.name, request.version)
            config = await self._call(context, request.name, "config")
            return pb.ModelConfigResponse(config=json_format.ParseDict(config, model_config_pb2.ModelConfig()))
        return await self._guard(context, work)

    async def ModelStatistics(self, request, context):
        async def work():
            states = await self.model_states()
            if request.name and request.name not in states:
                raise _Failed(404, f"model {request.name!r} not found")
            stats = triton_ext.model_stats([request.name] if request.name else sorted(states))
            return json_format.ParseDict(stats, pb.ModelStatisticsResponse())
        return await self._guard(context, work)


class HealthServicer(health_pb2_grpc.HealthServicer):
    """grpc.health.v1 for probes: ``live``/``""`` always, ``ready`` when every model is."""

    LIVE = ("", "live")
    READY = ("ready", "inference.GRPCInferenceService")

    def __init__(self, model_states: ModelStates) -> None:
        self.model_states = model_states

    async def Check(self, request, context):
        status = health_pb2.HealthCheckResponse
        if request.service in self.LIVE:
            return status(status=status.SERVING)
        if request.service in self.READY:
            states = await self.model_states()
            ready = bool(states) and all(s == "ready" for s in states.values())
            return status(status=status.SERVING if ready else status.NOT_SERVING)
        await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown service {request.service!r}; ask for 'live' or 'ready'")


async def start(host: str, port: int, max_message_bytes: int, model_states: ModelStates,
                call_model: CallModel, local: str | None = None) -> grpc.aio.Server:
    """Start the gRPC server on ``host:port`` in the running event loop; returns it.

    Every server of a deployment binds the same port with SO_REUSEPORT (the model
    replicas' and, while no model is ready, the server app's); the kernel spreads the
    connections over them.
    """
    server = grpc.aio.server(options=[
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", -1),
        ("grpc.so_reuseport", 1),
    ])
    servicer = InferenceServicer(model_states, call_model, local)
    service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(servicer, server)
    health_pb2_grpc.add_HealthServicer_to_server(HealthServicer(model_states), server)
    address = f"{host}:{port}"
    if server.add_insecure_port(address) == 0:
        raise RuntimeError(f"gRPC: cannot listen on {address} (port in use?); choose another with --grpc-port")
    await server.start()
    logger.info("gRPC inference service on %s", address)
    return server
