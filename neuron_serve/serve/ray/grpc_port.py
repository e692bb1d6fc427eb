"""Who serves the gRPC port, as recorded in Ray's KV store.

Behind HAProxy (a Ray that ``deploy`` started, ingress haproxy), HAProxy holds the port
and each replica registers the port of its gRPC-over-HTTP/1.1 listener (``grpc_h1``),
keyed by its actor's name, which HAProxy's configuration reads when Serve renders it
(``haproxy_template``). Otherwise the replicas share the port: the server app listens
on it only while no model is ready and records whether it does, so that ``deploy`` says
ready only once the models' replicas have the port, and each model replica registers
the private address its relayed calls go to (grpc_service.Relay). Either way ``deploy``
says ready only once real calls through the port answer (`answers`).
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any

import ray
from ray.experimental import internal_kv

if TYPE_CHECKING:  # Serve's HAProxy manager imports this module: the schema would bring torch into it
    from ...config.schema import ModelConfig

NAMESPACE = "neuron-serve"  # the deployment's Ray namespace (deployment.SERVER_APP)
LISTENING_KEY = "grpc-server-app-listening"
FRONT_KEY = "grpc-front"  # "1" when HAProxy holds the port
HAND_OVER_WAIT_S = 15.0
# One key per model replica: "grpc-relay/{model}/{replica}/{address}" (model names have no "/").
RELAY_PREFIX = "grpc-relay/"
# One key per replica behind HAProxy: "grpc-h1/{actor name}" -> its listener's port.
H1_PREFIX = "grpc-h1/"


def options(configs: list[ModelConfig], host: str, port: int | None) -> dict | None:
    """Where the gRPC service listens (``port`` overrides the first model.yaml's), or
    None when the first model.yaml turns it off and no port is given."""
    first = configs[0].grpc
    if port is None and not first.enabled:
        return None
    return {"host": host, "port": port or first.port,
            "max_message_bytes": max(c.http.max_request_bytes for c in configs)}


async def start_for_replica(options: dict, model_states, call_model, model: str | None = None,
                            replica: str = "") -> tuple[Any, Any, str]:
    """Start this replica's share of the gRPC service: (its server, its relay or None, the key to
    unregister). Behind HAProxy, a listener HAProxy sends calls to (``model``'s, or with None the
    server app's); else ``model``'s calls on the shared port, with a private port for relays."""
    from ..grpc import service as grpc_service  # noqa: PLC0415

    if options.get("front"):
        server, port = await grpc_service.start_behind_haproxy(options["max_message_bytes"], model_states,
                                                               call_model, local=model)
        return server, None, await register_h1(ray.get_runtime_context().get_actor_name(), port)
    # gRPC calls for this model run here, with no hop through another replica; other
    # replicas relay theirs for it to the private address registered here.
    server, relay, private = await grpc_service.start(
        options["host"], options["port"], options["max_message_bytes"], model_states, call_model, local=model,
        registry=relay_addresses, private_host=ray.util.get_node_ip_address())
    return server, relay, await register_relay(model, replica, private)


def front(started_here: bool, ingress: str) -> bool:
    """Whether HAProxy holds the gRPC port: a Ray started by this deploy with the HAProxy
    ingress (its HAProxy renders the patched template), or a server such a deploy started
    (a model deployed into it with --address follows it)."""
    if started_here:
        on = ingress == "haproxy"
        internal_kv._internal_kv_put(FRONT_KEY, b"1" if on else b"0", namespace=NAMESPACE)  # noqa: SLF001
        return on
    return internal_kv._internal_kv_get(FRONT_KEY, namespace=NAMESPACE) == b"1"  # noqa: SLF001


def answers(options: dict, models: list[str], direct: list[str], token: str | None = None,
            timeout_s: float = 5.0) -> str | None:
    """None when the gRPC port answers as a client that connects now needs it to, else what it
    does not answer yet: ServerReady says ready (behind HAProxy: the server app's listener is
    routed), ModelReady says ready for each of ``models``, and for each of ``direct`` it is
    answered by a replica of that model (HAProxy routes its calls straight to its replicas, not
    to the server app; see service.ANSWERED_BY). Real calls on a new connection, as a client's
    (``token``: the models' bearer token, when they have one)."""
    import grpc  # noqa: PLC0415
    from tritonclient.grpc import service_pb2, service_pb2_grpc  # noqa: PLC0415

    from ..grpc.service import ANSWERED_BY  # noqa: PLC0415

    host = "127.0.0.1" if options["host"] in ("0.0.0.0", "::", "") else options["host"]
    address = f"{host}:{options['port']}"
    metadata = (("authorization", f"Bearer {token}"),) if token else ()
    # A connection of its own: a channel shared with earlier calls could still be talking to an
    # HAProxy process that a reload has replaced.
    with grpc.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)]) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        call = "ServerReady"
        try:
            if not stub.ServerReady(service_pb2.ServerReadyRequest(), timeout=timeout_s).ready:
                return f"gRPC {address}: ServerReady answers not ready"
            for name in models:
                call = f"ModelReady({name!r})"
                answer, done = stub.ModelReady.with_call(service_pb2.ModelReadyRequest(name=name), timeout=timeout_s,
                                                         metadata=metadata)
                if not answer.ready:
                    return f"gRPC {address}: {call} answers not ready"
                if name in direct and (ANSWERED_BY, name) not in tuple(done.trailing_metadata() or ()):
                    return f"gRPC {address}: {call} is not answered by the model's replicas yet"
        except grpc.RpcError as err:  # UNAVAILABLE while HAProxy routes to no replica yet
            return f"gRPC {address}: {call} failed: {err.code().name}: {err.details()}"
    return None


def record_listening(on: bool) -> None:
    """The server app says whether it listens on the port."""
    internal_kv._internal_kv_put(LISTENING_KEY, b"1" if on else b"0", namespace=NAMESPACE)  # noqa: SLF001


def wait_for_hand_over() -> None:
    """Wait until the server app has left the port to the models' replicas, so that no
    client connecting after deploy says ready lands on a server about to close."""
    deadline = time.monotonic() + HAND_OVER_WAIT_S
    while time.monotonic() < deadline:
        if internal_kv._internal_kv_get(LISTENING_KEY, namespace=NAMESPACE) == b"0":  # noqa: SLF001
            return
        time.sleep(0.2)


async def register_relay(model: str, replica: str, address: str) -> str:
    """Record a model replica's private address; returns the key to unregister it with."""
    key = f"{RELAY_PREFIX}{model}/{replica}/{address}"
    await asyncio.get_running_loop().run_in_executor(
        None, lambda: internal_kv._internal_kv_put(key, b"", namespace=NAMESPACE))  # noqa: SLF001
    return key


async def register_h1(actor: str, port: int) -> str:
    """Record the port of a replica's gRPC-over-HTTP/1.1 listener; returns the key to unregister it with."""
    key = f"{H1_PREFIX}{actor}"
    await asyncio.get_running_loop().run_in_executor(
        None, lambda: internal_kv._internal_kv_put(key, str(port).encode(), namespace=NAMESPACE))  # noqa: SLF001
    return key


def h1_ports() -> dict[str, int]:
    """Every registered listener's port, by the replica's actor name (read when HAProxy's config is rendered)."""
    ports = {}
    for key in internal_kv._internal_kv_list(H1_PREFIX, namespace=NAMESPACE):  # noqa: SLF001
        value = internal_kv._internal_kv_get(key, namespace=NAMESPACE)  # noqa: SLF001
        if value:
            ports[key.decode()[len(H1_PREFIX):]] = int(value)
    return ports


async def unregister(key: str) -> None:
    """Forget a key registered here (a replica's relay address or listener port)."""
    await asyncio.get_running_loop().run_in_executor(
        None, lambda: internal_kv._internal_kv_del(key, namespace=NAMESPACE))  # noqa: SLF001


async def relay_addresses() -> dict[str, list[str]]:
    """Every model's registered private gRPC addresses (the replicas' relay ports)."""
    keys = await asyncio.get_running_loop().run_in_executor(
        None, lambda: internal_kv._internal_kv_list(RELAY_PREFIX, namespace=NAMESPACE))  # noqa: SLF001
    addresses: dict[str, list[str]] = {}
    for key in keys:
        model, _replica, address = key.decode()[len(RELAY_PREFIX):].split("/", 2)
        addresses.setdefault(model, []).append(address)
    return {model: sorted(found) for model, found in addresses.items()}
