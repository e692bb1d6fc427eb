"""OIP v2 over gRPC: ``inference.GRPCInferenceService`` of KServe and Triton.

Behind HAProxy (a Ray that ``deploy`` started, HAProxy ingress), HAProxy holds the port
and sends each call over HTTP/1.1 to a listener of the replica of the model it names, or
of the server app (``start_behind_haproxy``, ``grpc_h1``, ``haproxy_template``): the
servicers below run there, with nothing to relay. Otherwise:

Every model replica runs one gRPC server beside its HTTP one, all on one port
(SO_REUSEPORT): a call for the replica's own model runs on its data plane in the
process that received it, with no hop. KServe's and Triton's clients name the model
inside each message (``model_name``), not in call metadata, so Ray Serve's gRPC proxy,
which routes by an ``application`` metadata key, cannot route them unchanged; a call
for another model is relayed as it came (its bytes, metadata and deadline) to a replica
of that model: every model replica also listens on a private port of its node and
registers it (`Relay`, Ray's KV store), so the relay is one gRPC call with no parsing or
Serve routing on the way, and the owner's answer (or error status and message) goes
back unchanged. While no replica of the model is registered, the call takes the Serve
path: its application's state (not found, not ready) and a Serve handle call
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

import asyncio
import logging
import time
from typing import Any, Awaitable, Callable

import grpc
from google.protobuf import json_format
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tritonclient.grpc import model_config_pb2, service_pb2 as pb, service_pb2_grpc

from ... import __version__, metrics
from ...errors import ModelNotFound, ModelNotReady, NeuronServeError
from ..http import auth
from ..infer import triton as triton_ext
from .h1 import GrpcOverH1
from ..protocols import oip_grpc

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
# -> every model's registered private gRPC addresses (Relay)
Registry = Callable[[], Awaitable[dict[str, list[str]]]]

SERVICE = "inference.GRPCInferenceService"
# Metadata a relayed call carries: its receiver runs it itself or takes the Serve path,
# never relays it again.
RELAYED = "x-neuron-serve-relayed"
# Trailing metadata of the errors answered to a relayed call: the owner's own answer, to
# pass on as it is, unlike an UNAVAILABLE of the connection (a replica gone), retried.
ANSWERED = "x-neuron-serve-answer"
# Trailing metadata of a ModelReady answered by a replica of the model it names (its value: the
# model), not by another replica or the server app: deploy's readiness check (ray/grpc_port.answers)
# reads it to know that the model's calls reach its own replicas.
ANSWERED_BY = "x-neuron-serve-model"
RELAY_TTL_S = 2.0  # how long a list of addresses is used before the registry is read again
RELAY_DOWN_S = 30.0  # how long an address that refused a connection is skipped
# Metadata keys gRPC sets itself, not passed on by a relay.
_TRANSPORT_KEYS = frozenset({"user-agent", "content-type", "te", "grpc-timeout", "grpc-encoding",
                             "grpc-accept-encoding", "host"})


class _Failed(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class _Answered(Exception):
    """The error status and message a model's replica answered a relayed call."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code = code
        self.details = details


def _relayed(context: grpc.aio.ServicerContext) -> bool:
    return any(key == RELAYED for key, _ in context.invocation_metadata() or ())


class Relay:
    """Calls for another model, sent as they came to its replicas' private gRPC ports.

    ``registry`` reads every model's registered addresses (Ray's KV store); they are kept
    for ``ttl_s`` and read again sooner when an address refuses a connection. The
    replicas of a model take turns (round-robin). One channel per address, reused.
    """

    def __init__(self, registry: Registry, ttl_s: float = RELAY_TTL_S) -> None:
        self.registry = registry
        self.ttl_s = ttl_s
        self._addresses: dict[str, list[str]] = {}
        self._read_at = float("-inf")
        self._reading: asyncio.Task | None = None
        self._down: dict[str, float] = {}  # address -> monotonic time it is skipped until
        self._turn = 0
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._calls: dict[tuple[str, str], grpc.aio.UnaryUnaryMultiCallable] = {}

    async def _read(self) -> None:
        try:
            self._addresses = await self.registry()
        except Exception as exc:  # Ray's GCS busy or restarting: keep the last list a while longer
            logger.debug("gRPC relay: registry not read: %s", exc)
        self._read_at = time.monotonic()

    async def addresses(self, model: str, fresh: bool = False) -> list[str]:
        """The registered addresses of ``model``'s replicas but those refusing connections."""
        stale = time.monotonic() - self._read_at > self.ttl_s
        if fresh or stale:
            if self._reading is None or self._reading.done():
                self._reading = asyncio.get_running_loop().create_task(self._read())
            if fresh or self._read_at == float("-inf"):
                await asyncio.shield(self._reading)  # the first read, or one wanted now; else read behind
        now = time.monotonic()
        return [a for a in self._addresses.get(model, ()) if self._down.get(a, 0.0) <= now]

    def _call(self, address: str, path: str) -> grpc.aio.UnaryUnaryMultiCallable:
        call = self._calls.get((address, path))
        if call is None:
            channel = self._channels.get(address)
            if channel is None:
                channel = self._channels[address] = grpc.aio.insecure_channel(address, options=[
                    ("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1)])
            call = self._calls[(address, path)] = channel.unary_unary(path)  # bytes in, bytes out
        return call

    def _drop(self, address: str) -> None:
        self._down[address] = time.monotonic() + RELAY_DOWN_S
        self._calls = {key: call for key, call in self._calls.items() if key[0] != address}
        channel = self._channels.pop(address, None)
        if channel is not None:
            asyncio.get_running_loop().create_task(channel.close())

    async def call(self, model: str, path: str, payload: bytes, context: grpc.aio.ServicerContext) -> bytes | None:
        """The answer of a replica of ``model`` to ``payload`` (a request's bytes), or
        None when none is registered or reachable (the caller takes the Serve path).

        Raises `_Answered` with the replica's error status and message.
        """
        metadata = tuple((key, value) for key, value in context.invocation_metadata() or ()
                         if key not in _TRANSPORT_KEYS and not key.startswith(":")) + ((RELAYED, "1"),)
        tried: set[str] = set()
        for attempt in range(2):  # another replica once, after one refused the connection
            choices = [a for a in await self.addresses(model, fresh=attempt > 0) if a not in tried]
            if not choices:
                return None
            self._turn += 1
            address = choices[self._turn % len(choices)]
            try:
                return await self._call(address, path)(payload, metadata=metadata, timeout=context.time_remaining())
            except grpc.aio.AioRpcError as err:
                answered = any(key == ANSWERED for key, _ in err.trailing_metadata() or ())
                if answered or err.code() != grpc.StatusCode.UNAVAILABLE:
                    raise _Answered(err.code(), err.details() or "") from None
                logger.info("gRPC relay: %s (model %r) is unavailable: %s", address, model, err.details())
                tried.add(address)
                self._drop(address)
        return None

    async def close(self) -> None:
        channels, self._channels, self._calls = list(self._channels.values()), {}, {}
        for channel in channels:
            await channel.close()


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
            plane.admit()  # refuse before decoding when the queue is full
            return ("ok", await infer(plane, payload))
        raise NeuronServeError(f"unknown model call {method!r}")
    except NeuronServeError as exc:
        return ("error", exc.http_status, str(exc))
    except Exception as exc:  # a fault of the server or the model: still an answer with a message
        return ("error", 500, f"internal error: {type(exc).__name__}: {exc}")


async def infer(plane: Any, payload: bytes | pb.ModelInferRequest) -> pb.ModelInferResponse:
    """One ``ModelInferRequest`` (or its bytes) through the plane; the answer.

    The message is decoded (`oip_grpc`) into tensors over its own bytes, run by the plane,
    and the answer encoded from the output tensors, inside the request's `InferCall` (the
    codec's work timed and counted with it): no other protocol's form is made on the way.
    """
    with plane.begin() as call:
        message = payload if isinstance(payload, pb.ModelInferRequest) else pb.ModelInferRequest.FromString(payload)
        request = oip_grpc.decode_request(message, max_elements=plane.max_elements)
        return oip_grpc.encode_response(await plane.infer(request, call))


class InferenceServicer(service_pb2_grpc.GRPCInferenceServiceServicer):
    """The gRPC inference service of every model deployed together."""

    def __init__(self, model_states: ModelStates, call_model: CallModel, local: str | None = None,
                 relay: Relay | None = None) -> None:
        self.model_states = model_states
        self.call_model = call_model
        # The model served by this very process, if any: its calls need no state
        # lookup (its data plane knows whether it is ready) and no forwarding.
        self.local = local
        self.relay = relay
        self._forwarded: dict[tuple[str, str], Any] = {}

    # -- helpers ---------------------------------------------------------------------

    @staticmethod
    async def _abort(context: grpc.aio.ServicerContext, code: grpc.StatusCode, message: str) -> None:
        # A relayed call's error is marked as this replica's answer, for the relay to pass on.
        await context.abort(code, message, ((ANSWERED, "1"),) if _relayed(context) else ())

    async def _authorize(self, context: grpc.aio.ServicerContext) -> None:
        token = auth.current_token()
        if token is None:
            return
        header = dict(context.invocation_metadata() or ()).get("authorization")
        if not auth.authorized(header, token):
            problem = "missing Authorization header" if header is None else "invalid bearer token"
            await self._abort(context, grpc.StatusCode.UNAUTHENTICATED,
                              f"unauthorized: {problem}; send 'authorization: Bearer <token>' metadata")

    def _count(self, name: str, via: str) -> None:
        counter = self._forwarded.get((name, via))
        if counter is None:
            counter = self._forwarded[(name, via)] = metrics.GRPC_FORWARDED.labels(name, via)
        counter.inc()

    async def _relay(self, context, name: str, method: str, payload: bytes) -> bytes | None:
        """Another model's answer through `Relay` (bytes), or None to take the Serve path."""
        if name == self.local or self.relay is None or _relayed(context):
            return None
        answer = await self.relay.call(name, f"/{SERVICE}/{method}", payload, context)
        if answer is not None:
            self._count(name, "relay")
        return answer

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
            self._count(name, "serve")
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
            await self._abort(context, STATUS_CODES.get(exc.status, grpc.StatusCode.INTERNAL), str(exc))
        except _Answered as exc:
            await self._abort(context, exc.code, exc.details)

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
            if request.name == self.local:
                context.set_trailing_metadata(((ANSWERED_BY, self.local),))
            return pb.ModelReadyResponse(ready=state == "ready")
        return await self._guard(context, work)

    async def ServerMetadata(self, request, context):
        async def work():
            return pb.ServerMetadataResponse(name="neuron-serve", version=__version__,
                                             extensions=triton_ext.EXTENSIONS)
        return await self._guard(context, work)

    async def ModelMetadata(self, request, context):
        async def work():
            relayed = await self._relay(context, request.name, "ModelMetadata", request.SerializeToString())
            if relayed is not None:
                return pb.ModelMetadataResponse.FromString(relayed)
            self._version(request.name, request.version)
            meta = await self._call(context, request.name, "metadata")
            response = pb.ModelMetadataResponse(name=meta["name"], versions=meta["versions"], platform=meta["platform"])
            for kind in ("inputs", "outputs"):
                for tensor in meta[kind]:
                    getattr(response, kind).add(name=tensor["name"], datatype=tensor["datatype"], shape=tensor["shape"])
            return response
        return await self._guard(context, work)

    async def ModelInfer(self, request, context):
        """``request`` is the message's bytes (see `start`); the answer a message, or the
        bytes of another model's replica's answer."""
        raw = request
        request = pb.ModelInferRequest.FromString(raw)  # a malformed one fails as grpc's own parsing would

        async def work():
            relayed = await self._relay(context, request.model_name, "ModelInfer", raw)
            if relayed is not None:
                return relayed
            self._version(request.model_name, request.model_version)
            local = request.model_name == self.local
            answer = await self._call(context, request.model_name, "infer", request if local else raw)
            return answer if isinstance(answer, pb.ModelInferResponse) else pb.ModelInferResponse.FromString(answer)
        return await self._guard(context, work)

    async def ModelConfig(self, request, context):
        async def work():
            relayed = await self._relay(context, request.name, "ModelConfig", request.SerializeToString())
            if relayed is not None:
                return pb.ModelConfigResponse.FromString(relayed)
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


class _Handlers:
    """Takes the method handlers the generated code would add to a server."""

    def add_generic_rpc_handlers(self, handlers) -> None:
        pass

    def add_registered_method_handlers(self, service: str, handlers: dict) -> None:
        self.handlers = dict(handlers)


def _serialize_answer(answer: pb.ModelInferResponse | bytes) -> bytes:
    return answer if type(answer) is bytes else answer.SerializeToString()


def _inference_handlers(servicer: InferenceServicer) -> dict[str, Any]:
    """The generated service's handlers, but ModelInfer takes the request's bytes (a relay
    passes them on unparsed and unwritten) and answers a message or a relayed answer's bytes."""
    taken = _Handlers()
    service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(servicer, taken)
    handlers = taken.handlers
    handlers["ModelInfer"] = grpc.unary_unary_rpc_method_handler(servicer.ModelInfer,
                                                                 response_serializer=_serialize_answer)
    return handlers


def _add_inference_service(server: grpc.aio.Server, servicer: InferenceServicer) -> None:
    handlers = _inference_handlers(servicer)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    server.add_registered_method_handlers(SERVICE, handlers)


def method_handlers(servicer: InferenceServicer, health: HealthServicer) -> dict[str, Any]:
    """Every method's handler by its path (``/inference.GRPCInferenceService/ModelInfer``): both services."""
    taken = _Handlers()
    health_pb2_grpc.add_HealthServicer_to_server(health, taken)
    return {**{f"/{SERVICE}/{name}": h for name, h in _inference_handlers(servicer).items()},
            **{f"/grpc.health.v1.Health/{name}": h for name, h in taken.handlers.items()}}


async def start_behind_haproxy(max_message_bytes: int, model_states: ModelStates, call_model: CallModel,
                               local: str | None = None) -> tuple[GrpcOverH1, int]:
    """The service over HTTP/1.1 for HAProxy's gRPC front (see grpc_h1), on a free port of
    every interface (HAProxy on any node may reach it); returns the server and its port.

    HAProxy sends a replica only its own model's calls, so nothing is relayed."""
    servicer = InferenceServicer(model_states, call_model, local)
    server = GrpcOverH1(method_handlers(servicer, HealthServicer(model_states)), max_message_bytes)
    port = await server.start("0.0.0.0", 0)
    logger.info("gRPC inference service behind HAProxy: listening for it on port %d", port)
    return server, port


async def start(host: str, port: int, max_message_bytes: int, model_states: ModelStates,
                call_model: CallModel, local: str | None = None, registry: Registry | None = None,
                private_host: str | None = None) -> tuple[grpc.aio.Server, Relay | None, str | None]:
    """Start the gRPC server on ``host:port`` in the running event loop.

    Every server of a deployment binds the same port with SO_REUSEPORT (the model
    replicas' and, while no model is ready, the server app's); the kernel spreads the
    connections over them. With ``private_host`` it also listens on a port of its own
    there (for calls other replicas relay to this one; the caller registers it). With
    ``registry`` calls for another model are relayed to the addresses it lists.
    Returns the server, its relay and the private address (None without them).
    """
    server = grpc.aio.server(options=[
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", -1),
        ("grpc.so_reuseport", 1),
    ])
    relay = Relay(registry) if registry is not None else None
    servicer = InferenceServicer(model_states, call_model, local, relay)
    _add_inference_service(server, servicer)
    health_pb2_grpc.add_HealthServicer_to_server(HealthServicer(model_states), server)
    address = f"{host}:{port}"
    if server.add_insecure_port(address) == 0:
        raise RuntimeError(f"gRPC: cannot listen on {address} (port in use?); choose another with --grpc-port")
    private = None
    if private_host is not None:
        # Port 0: the kernel picks a free port, never one shared through SO_REUSEPORT.
        host_part = f"[{private_host}]" if ":" in private_host else private_host
        private_port = server.add_insecure_port(f"{host_part}:0")
        if private_port == 0:
            raise RuntimeError(f"gRPC: cannot listen on a port of {private_host} for relayed calls")
        private = f"{host_part}:{private_port}"
    await server.start()
    logger.info("gRPC inference service on %s%s", address, f" (relayed calls: {private})" if private else "")
    return server, relay, private
