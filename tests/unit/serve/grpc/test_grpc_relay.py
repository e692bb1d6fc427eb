"""A gRPC call for another model, relayed to a replica of it (grpc_service.Relay), in one
process: two model "replicas" (gRPC servers of models a and b, each with its private
port) and fake Serve paths. The owner's answers, errors included, reach the client as
they are; a replica gone is skipped; with none registered the Serve path answers."""

import asyncio

import grpc
import pytest
from tritonclient.grpc import service_pb2 as pb, service_pb2_grpc

from neuron_serve.serve.http import auth
from neuron_serve.serve.grpc import service as grpc_service

TOKEN = "relay-test-token-0123456789"
AUTH = (("authorization", f"Bearer {TOKEN}"),)


class Replica:
    """One model's gRPC server; its model's calls answered by ``answer``, and the calls
    it sends through the Serve path (another model's) recorded."""

    def __init__(self, model: str, registry, states):
        self.model = model
        self.registry = registry
        self.states = states
        self.served: list[tuple[str, str]] = []  # (model, method) through the Serve path
        self.answered = 0
        self.deadlines: list[float | None] = []

    async def call_model(self, name: str, method: str, payload) -> tuple:
        if name != self.model:
            self.served.append((name, method))
            return ("ok", pb.ModelInferResponse(model_name=name, id="via serve").SerializeToString())
        self.answered += 1
        if method == "metadata":
            return ("ok", {"name": name, "versions": ["1"], "platform": "test", "inputs": [], "outputs": []})
        request = payload if isinstance(payload, pb.ModelInferRequest) else pb.ModelInferRequest.FromString(payload)
        if request.id == "bad":
            return ("error", 400, f"input 'x' of {name} is bad")
        if request.id == "full":
            return ("error", 503, "queue full: try again")
        return ("ok", pb.ModelInferResponse(model_name=name, id=f"{request.id} by {self.model}"))

    async def start(self):
        self.server, self.relay, self.private = await grpc_service.start(
            "127.0.0.1", 0, 1 << 20, self.states, self.call_model, local=self.model, registry=self.registry,
            private_host="127.0.0.1")
        return self


def run(scenario):
    auth.configure(TOKEN)
    try:
        asyncio.run(scenario())
    finally:
        auth.configure(None)


async def setup(addresses: dict[str, list[str]], extra: dict[str, list[str]] | None = None):
    """Replicas of a and b; ``addresses`` is what the registry lists (filled in here)."""
    async def registry():
        return addresses

    async def states():
        return {"a": "ready", "b": "ready", "c": "deploying"}

    a = await Replica("a", registry, states).start()
    b = await Replica("b", registry, states).start()
    addresses.update({"a": [a.private], "b": [b.private], **(extra or {})})
    return a, b


async def public_stub(replica):
    """A client of ``replica``'s own server, through its private address (as the shared
    port would land it there)."""
    channel = grpc.aio.insecure_channel(replica.private)
    return channel, service_pb2_grpc.GRPCInferenceServiceStub(channel)


async def stop(*replicas):
    for r in replicas:
        if r.relay is not None:
            await r.relay.close()
        await r.server.stop(0)


def infer(model: str, request_id: str = "r") -> pb.ModelInferRequest:
    return pb.ModelInferRequest(model_name=model, id=request_id)


def test_another_models_call_is_relayed_to_its_replica_not_through_serve():
    async def scenario():
        addresses: dict = {}
        a, b = await setup(addresses)
        channel, stub = await public_stub(a)
        try:
            answer = await stub.ModelInfer(infer("b", "r1"), metadata=AUTH, timeout=10)
            assert (answer.model_name, answer.id) == ("b", "r1 by b")
            meta = await stub.ModelMetadata(pb.ModelMetadataRequest(name="b"), metadata=AUTH, timeout=10)
            assert (meta.name, meta.platform) == ("b", "test")
            assert (await stub.ModelInfer(infer("a", "r2"), metadata=AUTH, timeout=10)).id == "r2 by a"
            assert a.served == [] and b.answered == 2 and a.answered == 1
        finally:
            await channel.close()
            await stop(a, b)
    run(scenario)


def test_the_owners_errors_pass_unchanged_and_a_refusal_is_not_retried():
    async def scenario():
        a, b = await setup({})
        channel, stub = await public_stub(a)
        try:
            for request_id, code, message in (("bad", grpc.StatusCode.INVALID_ARGUMENT, "input 'x' of b is bad"),
                                              ("full", grpc.StatusCode.UNAVAILABLE, "queue full: try again")):
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await stub.ModelInfer(infer("b", request_id), metadata=AUTH, timeout=10)
                assert (err.value.code(), err.value.details()) == (code, message)
                assert dict(err.value.trailing_metadata() or ()).get(grpc_service.ANSWERED) is None
            assert b.answered == 2 and a.served == []  # answered once each, no retry, no Serve path
            with pytest.raises(grpc.aio.AioRpcError) as err:  # the relay forwards the caller's token
                await stub.ModelInfer(infer("b"), metadata=(("authorization", "Bearer wrong-token-00000"),),
                                      timeout=10)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert "invalid bearer token" in err.value.details()
        finally:
            await channel.close()
            await stop(a, b)
    run(scenario)


def test_a_replica_gone_is_skipped_and_with_none_left_the_serve_path_answers():
    async def scenario():
        addresses: dict = {}
        a, b = await setup(addresses)
        gone = await Replica("b", None, None).start()  # a port that refuses connections once stopped
        await stop(gone)
        addresses["b"] = [gone.private, b.private]
        channel, stub = await public_stub(a)
        try:
            for n in range(4):  # every call answered by the live replica (retried once past the gone one)
                assert (await stub.ModelInfer(infer("b", f"r{n}"), metadata=AUTH, timeout=10)).id == f"r{n} by b"
            assert a.served == []
            addresses["b"] = [gone.private]
            a.relay._down.clear()  # noqa: SLF001 - as after RELAY_DOWN_S
            answer = await stub.ModelInfer(infer("b", "r9"), metadata=AUTH, timeout=10)
            assert answer.id == "via serve" and a.served == [("b", "infer")]
            with pytest.raises(grpc.aio.AioRpcError) as err:  # not registered: the Serve path's messages
                await stub.ModelInfer(infer("nope"), metadata=AUTH, timeout=10)
            assert (err.value.code(), err.value.details()) == (grpc.StatusCode.NOT_FOUND, "model 'nope' not found")
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.ModelInfer(infer("c"), metadata=AUTH, timeout=10)
            assert (err.value.code(), err.value.details()) == (grpc.StatusCode.UNAVAILABLE,
                                                               "model 'c' is not ready (deploying)")
        finally:
            await channel.close()
            await stop(a, b)
    run(scenario)


def test_a_relayed_call_is_not_relayed_again():
    async def scenario():
        addresses: dict = {}
        a, b = await setup(addresses)
        addresses["b"] = [a.private]  # a stale registration: b's address now reaches a
        channel, stub = await public_stub(b)
        try:
            answer = await stub.ModelInfer(infer("b", "r1"), metadata=AUTH, timeout=10)
            assert answer.id == "r1 by b"  # b's own
            channel2, stub_a = await public_stub(a)
            answer = await stub_a.ModelInfer(infer("b", "r2"), metadata=AUTH, timeout=10)
            await channel2.close()
            assert answer.id == "via serve" and a.served == [("b", "infer")]  # a -> a, then Serve, no loop
        finally:
            await channel.close()
            await stop(a, b)
    run(scenario)


def test_a_malformed_message_fails_as_grpcs_own_parsing_does():
    async def scenario():
        a, b = await setup({})
        try:
            async with grpc.aio.insecure_channel(a.private) as channel:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await channel.unary_unary(f"/{grpc_service.SERVICE}/ModelInfer")(b"\xff\xff\xff", timeout=10)
            assert err.value.code() == grpc.StatusCode.UNKNOWN
            assert err.value.details().startswith("Unexpected <class 'google.protobuf.message.DecodeError'>")
        finally:
            await stop(a, b)
    run(scenario)
