"""The messages between a replica and its engine process: each kind crosses pickled as it was sent, no larger
than the tagged tuple it replaced, and a side refuses a message it has no handler for, saying which it takes."""

import dataclasses
import pickle
from multiprocessing import Pipe
from multiprocessing.reduction import ForkingPickler

import pytest

from neuron_serve.generation.process import messages
from neuron_serve.generation.process.messages import (
    Abort, AdapterReply, Batch, Close, Closed, Compiled, Dispatch, Failed, HostMemory, Kind, LoadAdapter, Ready,
    Start, Submit, UnknownMessage, UnloadAdapter, Usage
)
from neuron_serve.generation.frontend.protocol import EngineRequest, TokenEvent
from neuron_serve.generation.sample.sampling import SamplingParams
from neuron_serve.generation.process.worker import Outbox, _adapter_call

PADDING = {"prefill": {"padded_fraction": 0.25, "buckets": {"16": {"calls": 2, "real": 24, "padded": 8}}}}
REBUCKETING = {"generation.prefill_buckets": {"buckets": [5, 64], "every": 2, "switches": 1, "state": "serving"}}
EVENTS = [TokenEvent(f"req-{i}", 100 + i, prompt_tokens=12, completion_tokens=3) for i in range(32)]

ONE_OF_EACH = [
    Start({"name": "tiny", "task": "generate"}, "/models", "r0", ["/app"], (1, 2)),
    Submit(EngineRequest("req-0", [1, 2, 3], SamplingParams(max_tokens=6, temperature=0), adapter="qv")),
    Abort("req-0", "timeout"),
    LoadAdapter(7, "qv", "/adapters/qv"),
    UnloadAdapter(8, "qv"),
    Close(),
    Ready({"engines": 1, "slots": 2}, None, {"compiled": 2, "pending": 0, "failed": 0, "background": False}),
    Failed(pickle.dumps(ValueError("model.pretrained: missing"))),
    Batch(EVENTS[:2], Usage(PADDING, REBUCKETING)),
    Usage(PADDING, {}),
    Compiled({"compiled": 3, "pending": 1, "failed": 0, "background": True}),
    HostMemory({"resident_bytes": 1 << 30}),
    AdapterReply(7, pickle.dumps(KeyError("qv"))),
    Closed(),
]


def test_there_is_one_class_a_kind_and_each_is_a_frozen_slotted_dataclass():
    assert sorted(type(m).kind for m in ONE_OF_EACH) == sorted(Kind)
    assert {type(m) for m in ONE_OF_EACH} == set(messages.TO_ENGINES + messages.TO_REPLICA)
    for message in ONE_OF_EACH:
        assert dataclasses.is_dataclass(message) and not hasattr(message, "__dict__")
        field = next(iter(dataclasses.fields(message)), None)
        if field is not None:
            with pytest.raises(dataclasses.FrozenInstanceError):
                setattr(message, field.name, None)


@pytest.mark.parametrize("message", ONE_OF_EACH, ids=lambda m: type(m).kind.value)
def test_each_kind_crosses_pickled_as_it_was_sent(message):
    for data in (ForkingPickler.dumps(message), pickle.dumps(message)):  # the connection's pickler, and plain
        got = pickle.loads(data)
        assert type(got) is type(message) and got.kind is message.kind
        if isinstance(message, (Failed, AdapterReply)):  # exceptions compare by identity: their bytes are kept
            assert got.error == message.error
        elif isinstance(message, Submit):
            assert (got.request.request_id, got.request.prompt, got.request.adapter, got.request.params.max_tokens) \
                   == ("req-0", [1, 2, 3], "qv", 6)
        else:
            assert got == message


def test_a_message_pickles_no_larger_than_the_tuple_it_replaced_give_or_take_a_few_bytes():
    size = lambda m: len(ForkingPickler.dumps(m))  # noqa: E731
    assert size(Batch(EVENTS)) <= size(("events", EVENTS))  # a step's message, every step
    assert size(Batch(EVENTS[:1])) <= size(("events", EVENTS[:1]))
    request = EngineRequest("req-0", [1, 2, 3], SamplingParams(max_tokens=6))
    assert size(Submit(request)) <= size(("submit", request))
    assert size(LoadAdapter(1, "qv", "/a")) <= size(("adapter", 1, "load", "qv", "/a"))
    assert size(Close()) <= size(("close",)) and size(Closed()) <= size(("closed", None))
    assert size(Abort("req-0001", "abort")) <= size(("abort", "req-0001", "abort")) + 4


def test_dispatch_hands_a_message_to_its_class_handler_and_refuses_any_other_with_what_it_takes():
    seen = []
    handle = Dispatch("the engine process", {Submit: seen.append, Abort: lambda m: m.reason, Close: lambda _: True})
    assert handle(Abort("req-1", "timeout")) == "timeout" and handle(Close()) is True
    with pytest.raises(UnknownMessage, match=r"^the engine process got a message it does not take: tuple "
                                             r"\('submit', 'req-1'\); it takes abort, close, submit$"):
        handle(("submit", "req-1"))
    with pytest.raises(UnknownMessage, match=r"^the engine process got a message it does not take: closed Closed\(\); "
                                             r"it takes abort, close, submit$"):
        handle(Closed())  # the other direction's
    assert issubclass(UnknownMessage, TypeError) and seen == []


def test_the_outbox_sends_a_batch_with_one_usage_however_many_requests_it_ends():
    ours, theirs = Pipe()
    taken = []

    def usage() -> Usage:
        taken.append(1)
        return Usage(PADDING, REBUCKETING)

    outbox = Outbox(theirs, usage)
    ended = [dataclasses.replace(e, finish_reason="length") for e in EVENTS[:2]]
    with outbox._ready:  # a step's events, all posted before the outbox's thread takes any
        for event in (ended[0], EVENTS[5], ended[1]):
            outbox.post(event)
        outbox.tell(Compiled({"compiled": 1, "pending": 0, "failed": 0, "background": True}))
    assert ours.poll(10)
    with outbox._ready:  # a step that ends no request
        outbox.post(EVENTS[6])
    outbox.close()
    got = [ours.recv()]
    while not isinstance(got[-1], Closed):
        got.append(ours.recv())
    assert [type(m) for m in got] == [Compiled, Batch, Batch, Closed]
    assert got[1] == Batch([ended[0], EVENTS[5], ended[1]], Usage(PADDING, REBUCKETING)) and len(taken) == 1
    assert got[2] == Batch([EVENTS[6]])


def test_an_adapter_call_is_answered_with_its_call_and_the_error_it_raised():
    class Engines:
        def load_adapter(self, name, path):
            self.loaded = (name, path)

        def unload_adapter(self, name):
            raise KeyError(name)

    ours, theirs = Pipe()
    engines, outbox = Engines(), Outbox(theirs)
    _adapter_call(engines, outbox, LoadAdapter(1, "qv", "/adapters/qv"))
    _adapter_call(engines, outbox, UnloadAdapter(2, "gone"))
    outbox.close()
    loaded, unloaded, closed = ours.recv(), ours.recv(), ours.recv()
    assert engines.loaded == ("qv", "/adapters/qv") and loaded == AdapterReply(1) and isinstance(closed, Closed)
    assert unloaded.call == 2 and repr(pickle.loads(unloaded.error)) == "KeyError('gone')"
