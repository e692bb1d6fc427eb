"""gRPC behind HAProxy's HTTP/2 front (haproxy_template's gRPC section, grpc_h1), in one
process: the bundled HAProxy, configured by the section as Serve would render it, in front
of two model "replicas" (a and b) and the server app, each a gRPC-over-HTTP/1.1 listener
with the real servicers; the Serve paths behind them are stand-ins. Each model's calls
reach its own replica by the name its message starts with, the rest the server app, and
grpcio's client sees gRPC's statuses, messages, deadlines and compression."""

import asyncio
import contextlib
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from jinja2 import Environment
from tritonclient.grpc import service_pb2 as pb, service_pb2_grpc

from neuron_serve.serve.http import auth
from neuron_serve.serve.grpc import service as grpc_service
from neuron_serve.serve.ray import haproxy_template, ingress

TOKEN = "front-test-token-0123456789"
AUTH = (("authorization", f"Bearer {TOKEN}"),)
LIMIT = 1 << 20  # max_message_bytes
CONFIG = """global
    maxconn 256
defaults
    mode http
    timeout connect 5s
    timeout client 30s
    timeout server 30s
"""


class Replica:
    """A listener for ``model`` (None: the server app) whose Serve path records its calls."""

    def __init__(self, model: str | None) -> None:
        self.model = model
        self.calls: list[tuple[str, str]] = []

    async def states(self) -> dict[str, str]:
        return {"a": "ready", "b": "ready", "c": "deploying"}

    async def call_model(self, name: str, method: str, payload) -> tuple:
        self.calls.append((name, method))
        if method == "metadata":
            return ("ok", {"name": name, "versions": ["1"], "platform": f"replica {self.model}", "inputs": [],
                           "outputs": []})
        request = payload if isinstance(payload, pb.ModelInferRequest) else pb.ModelInferRequest.FromString(payload)
        if request.id == "bad":
            return ("error", 400, f"input 'x' of {name} is bad: ünïcode, 100% wrong")
        if request.id == "slow":
            await asyncio.sleep(5)
        return ("ok", pb.ModelInferResponse(model_name=name, id=f"{request.id} by {self.model}"))

    async def start(self) -> "Replica":
        self.server, self.port = await grpc_service.start_behind_haproxy(LIMIT, self.states, self.call_model,
                                                                         local=self.model)
        return self


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _backend(app: str, replica: Replica) -> SimpleNamespace:
    server = SimpleNamespace(name=f"SERVE_REPLICA_{app}", host="127.0.0.1", port=1, replica_id=f"actor-{app}")
    return SimpleNamespace(app_name=app, servers=[server])


def render(port: int, replicas: dict[str, Replica]) -> str:
    """The gRPC section as Serve's HAProxy manager renders it, for ``replicas`` by application."""
    front = haproxy_template.GrpcFront("127.0.0.1", port, {f"actor-{app}": r.port for app, r in replicas.items()})
    backends = [_backend(app, r) for app, r in replicas.items()] + [_backend("generating", Replica("g"))]
    return Environment().from_string(haproxy_template.GRPC_FRONT).render(
        config=SimpleNamespace(neuron_serve_grpc=front), backends=backends)


@contextlib.contextmanager
def haproxy(section: str):
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "haproxy.cfg"
        path.write_text(CONFIG + section + "\n")
        binary = ingress.haproxy_binary()
        subprocess.run([binary, "-c", "-q", "-f", str(path)], check=True)  # HAProxy's own parser accepts it
        proc = subprocess.Popen([binary, "-f", str(path)], stderr=subprocess.DEVNULL)
        try:
            yield proc
        finally:
            proc.terminate()
            proc.wait(timeout=10)


def run(scenario):
    auth.configure(TOKEN)
    try:
        asyncio.run(scenario())
    finally:
        auth.configure(None)


async def front():
    replicas = {"a": await Replica("a").start(), "b": await Replica("b").start(),
                haproxy_template.SERVER_APP: await Replica(None).start()}
    port = _free_port()
    return replicas, port, render(port, replicas)


async def connected(port: int) -> grpc.aio.Channel:
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    deadline = time.monotonic() + 10
    while True:
        try:
            await service_pb2_grpc.GRPCInferenceServiceStub(channel).ServerLive(pb.ServerLiveRequest(), timeout=1)
            return channel
        except grpc.aio.AioRpcError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.1)


def test_the_section_routes_each_model_by_the_name_its_body_starts_with():
    async def scenario():
        replicas, port, section = await front()
        assert "generating" not in section  # no listener registered (a generate model): not routed
        with haproxy(section):
            channel = await connected(port)
            stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
            for model in ("a", "b", "a"):
                answer = await stub.ModelInfer(pb.ModelInferRequest(model_name=model, id="r"), metadata=AUTH,
                                               timeout=10)
                assert (answer.model_name, answer.id) == (model, f"r by {model}")
            meta = await stub.ModelMetadata(pb.ModelMetadataRequest(name="b"), metadata=AUTH, timeout=10)
            assert meta.platform == "replica b"
            assert (await stub.ServerReady(pb.ServerReadyRequest(), timeout=10)).ready is False  # c deploys
            with pytest.raises(grpc.aio.AioRpcError) as err:  # no replica of it: the server app answers
                await stub.ModelInfer(pb.ModelInferRequest(model_name="nope"), metadata=AUTH, timeout=10)
            assert (err.value.code(), err.value.details()) == (grpc.StatusCode.NOT_FOUND, "model 'nope' not found")
            await channel.close()
        server = replicas[haproxy_template.SERVER_APP]
        assert replicas["a"].calls == [("a", "infer")] * 2 and replicas["b"].calls == [("b", "infer"),
                                                                                       ("b", "metadata")]
        assert server.calls == []  # nothing went through a Serve path
        for replica in replicas.values():
            await replica.server.stop(0)
    run(scenario)


def test_statuses_messages_deadlines_and_limits_are_grpcs():
    async def scenario():
        replicas, port, section = await front()
        with haproxy(section):
            channel = await connected(port)
            stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
            huge = pb.ModelInferRequest(model_name="a", id="x" * LIMIT)
            cases = [
                (pb.ModelInferRequest(model_name="a", id="bad"), AUTH, 10, grpc.StatusCode.INVALID_ARGUMENT,
                 "input 'x' of a is bad: ünïcode, 100% wrong"),
                (pb.ModelInferRequest(model_name="a"), (("authorization", "Bearer wrong-token-00000"),), 10,
                 grpc.StatusCode.UNAUTHENTICATED, "unauthorized: invalid bearer token; send 'authorization: Bearer "
                                                  "<token>' metadata"),
                (pb.ModelInferRequest(model_name="a", id="slow"), AUTH, 0.5, grpc.StatusCode.DEADLINE_EXCEEDED,
                 "Deadline Exceeded"),
                (huge, AUTH, 10, grpc.StatusCode.RESOURCE_EXHAUSTED,
                 f"Received message larger than max ({huge.ByteSize()} vs. {LIMIT})"),
                (pb.ModelInferRequest(model_name="c"), AUTH, 10, grpc.StatusCode.UNAVAILABLE,
                 "model 'c' is not ready (deploying)"),
            ]
            for request, metadata, timeout, code, details in cases:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await stub.ModelInfer(request, metadata=metadata, timeout=timeout)
                assert (err.value.code(), err.value.details()) == (code, details)
            with pytest.raises(grpc.aio.AioRpcError) as err:  # as grpcio's own server answers these
                await channel.unary_unary(f"/{grpc_service.SERVICE}/ModelInfer")(b"\x0a\x01a\xff\xff", timeout=10)
            assert err.value.code() == grpc.StatusCode.UNKNOWN
            assert err.value.details().startswith("Unexpected <class 'google.protobuf.message.DecodeError'>")
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await channel.unary_unary(f"/{grpc_service.SERVICE}/ModelStreamInfer")(b"", timeout=10)
            assert (err.value.code(), err.value.details()) == (grpc.StatusCode.UNIMPLEMENTED, "Method not found!")
            health = health_pb2_grpc.HealthStub(channel)
            checked = await health.Check(health_pb2.HealthCheckRequest(service="live"), timeout=10)
            assert checked.status == health_pb2.HealthCheckResponse.SERVING
            await channel.close()
            # A compressed message does not start with its model's name: the server app takes it
            # and calls the model through its Serve path.
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", compression=grpc.Compression.Gzip) as zipped:
                answer = await service_pb2_grpc.GRPCInferenceServiceStub(zipped).ModelInfer(
                    pb.ModelInferRequest(model_name="b", id="z" * 1000), metadata=AUTH, timeout=10)
                assert answer.id == "z" * 1000 + " by None"
            assert replicas[haproxy_template.SERVER_APP].calls == [("b", "infer")]
        for replica in replicas.values():
            await replica.server.stop(0)
    run(scenario)


def test_with_no_server_app_listener_haproxy_says_unavailable():
    async def scenario():
        port = _free_port()
        with haproxy(render(port, {})):
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                deadline = time.monotonic() + 10
                while True:
                    try:
                        await service_pb2_grpc.GRPCInferenceServiceStub(channel).ServerLive(pb.ServerLiveRequest(),
                                                                                            timeout=1)
                    except grpc.aio.AioRpcError as err:
                        if err.code() == grpc.StatusCode.UNAVAILABLE and "starting" in (err.details() or ""):
                            assert err.details() == ("the server is starting: no replica answers gRPC yet; retry "
                                                     "shortly")
                            return
                    assert time.monotonic() < deadline
                    await asyncio.sleep(0.1)
    run(scenario)


class AllReady(Replica):
    async def states(self) -> dict[str, str]:
        return {"a": "ready", "b": "ready"}


def test_deploy_calls_the_port_ready_only_once_each_models_replicas_answer_it():
    """grpc_port.answers, deploy's check, through HAProxy as routes appear: none (the server is
    starting), the server app's only (it answers for the models, but not from their replicas),
    then every model's: ready. A model's replica says so in ModelReady's trailing metadata."""
    from neuron_serve.serve.ray import grpc_port  # noqa: PLC0415

    async def scenario():
        replicas = {"a": await AllReady("a").start(), "b": await AllReady("b").start(),
                    haproxy_template.SERVER_APP: await AllReady(None).start()}
        options = {"host": "127.0.0.1", "port": _free_port()}

        async def answers() -> str | None:
            deadline = time.monotonic() + 10
            while True:  # past HAProxy's start
                problem = await asyncio.get_running_loop().run_in_executor(
                    None, lambda: grpc_port.answers(options, ["a", "b"], ["a", "b"], TOKEN, timeout_s=2))
                if "onnect" not in (problem or "") or time.monotonic() > deadline:
                    return problem
                await asyncio.sleep(0.1)

        address = f"gRPC 127.0.0.1:{options['port']}"
        with haproxy(render(options["port"], {})):
            assert await answers() == (f"{address}: ServerReady failed: UNAVAILABLE: the server is starting: no "
                                       "replica answers gRPC yet; retry shortly")
        with haproxy(render(options["port"], {haproxy_template.SERVER_APP: replicas[haproxy_template.SERVER_APP]})):
            assert await answers() == f"{address}: ModelReady('a') is not answered by the model's replicas yet"
        with haproxy(render(options["port"], replicas)):
            assert await answers() is None
            async with grpc.aio.insecure_channel(f"127.0.0.1:{options['port']}") as channel:
                call = service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelReady(
                    pb.ModelReadyRequest(name="b"), metadata=AUTH, timeout=10)
                assert (await call).ready
                assert (grpc_service.ANSWERED_BY, "b") in tuple(await call.trailing_metadata())
        for replica in replicas.values():
            await replica.server.stop(0)
    run(scenario)
