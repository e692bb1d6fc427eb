"""An engine step's three parts as plain data, with no device: the scheduler's plan (request ids and slots, no live
request), and RequestStates.update_from_output applying what a call gave (tokens, stops, ends, the prefix cache,
adapters' buffer slots, accepted proposals). The calls' outputs are written here as a runner returns them."""

from __future__ import annotations

import dataclasses
import itertools
import threading

import pytest
from prometheus_client import REGISTRY

import generation_models as gm
from generation_models import ATTENTION, make_adapter
from neuron_serve.generation.lora.adapters import AdapterPolicy, Adapters
from neuron_serve.generation.lora.adapter import LoraBase
from neuron_serve.generation.core.metrics import EngineMetrics
from neuron_serve.generation.core.plan import Admit, Decode, Prefill, PrefillBatch
from neuron_serve.generation.core.prefix_cache import BLOCK, PrefixCache
from neuron_serve.generation.core.request import Sequence, Status
from neuron_serve.generation.runner.calls import CallOutput
from neuron_serve.generation.sample.sampling import Sampled, SamplingParams
from neuron_serve.generation.core.scheduler import Scheduler
from neuron_serve.generation.runner.shapes import Shape
from neuron_serve.generation.core.states import RequestStates

EOS = 2
MAX_MODEL_LEN = 256
_names = itertools.count()


class Engine:
    """A scheduler and the request states over it, as the engine holds them; ``events`` each request's events."""

    def __init__(self, slots: int = 4, prefix: bool = False, adapters: Adapters | None = None) -> None:
        self.name = f"step-update-{next(_names)}"
        self.metrics = EngineMetrics(self.name, "0")
        cache = PrefixCache(MAX_MODEL_LEN - 1) if prefix else None
        self.scheduler = Scheduler(slots, 1024, cache, adapters=adapters)
        self.aborted: list[str] = []
        self.states = RequestStates(self.scheduler, self.metrics, frozenset({EOS}), MAX_MODEL_LEN, threading.Lock(),
                                    self.aborted.append, adapters)
        self.events: dict[str, list] = {}

    def submit(self, rid: str, prompt: list[int], adapter: str | None = None, **params) -> Sequence:
        seq = Sequence(rid, prompt, SamplingParams(**params), self.events.setdefault(rid, []).append)
        if adapter is not None:
            seq.adapter, seq.adapter_key = adapter, self.states.adapters.take(adapter)
        self.states.open[rid] = seq
        self.states.opened([seq])
        return seq

    def counted(self, metric: str, **labels) -> float:
        self.metrics.flush()
        return REGISTRY.get_sample_value(f"{metric}_total", {"model_name": self.name, "replica": "0", **labels}) or 0


def output(*rows: list[int], proposals=None, kind: str = "decode") -> CallOutput:
    return CallOutput([[Sampled(t) for t in row] for row in rows], Shape(kind, len(rows), 1, 64), proposals=proposals)


def prefill_all(engine: Engine):
    """Schedule a step and apply a first token (7) to each prompt it prefills; the plan."""
    plan = engine.scheduler.schedule()
    for call in plan.prefills:
        rows = engine.states.rows((call.request_id,))
        assert engine.states.update_from_output(call, rows, output([7], kind="prefill")) is True
    return plan


def test_a_plan_holds_request_ids_and_slots_in_the_order_its_calls_run():
    engine = Engine()
    engine.submit("a", [1, 3, 4])
    engine.submit("b", [1, 3, 5, 6])
    plan = engine.scheduler.schedule()
    assert plan.calls == [Admit("a", 0, None, 0), Admit("b", 1, None, 0), PrefillBatch((Prefill("a", 0, 3, 0, False),)),
                          PrefillBatch((Prefill("b", 1, 4, 0, False),)), Decode(("a", "b"))]
    for call in plan.calls:  # data only: what a call names is a string, a number or a tuple of them
        assert all(isinstance(v, (str, int, bool, tuple, type(None))) for v in dataclasses.astuple(call))
    assert [s.status for s in engine.scheduler.running.values()] == [Status.PREFILLING, Status.PREFILLING]


def test_update_from_output_appends_tokens_and_ends_on_a_stop_token_freeing_the_slot():
    engine = Engine()
    a = engine.submit("a", [1, 3, 4], stop_token_ids=[9])
    plan = prefill_all(engine)
    assert a.status is Status.RUNNING and a.output == [7]
    decode = plan.batch
    engine.states.update_from_output(decode, engine.states.rows(decode.rows), output([9]))
    assert a.status is Status.FINISHED and (a.finish_reason, a.stop_reason) == ("stop", 9)
    assert a.slot is None and engine.scheduler.free == [0, 1, 2, 3] and "a" not in engine.states.open
    engine.states.deliver()
    assert [(e.token, e.finish_reason) for e in engine.events["a"]] == [(7, None), (9, "stop")]
    assert engine.counted("neuron_serve_request_success", finished_reason="stop") == 1


def test_a_stop_string_found_by_the_front_end_aborts_with_reason_stop_and_a_finished_row_leaves_the_call():
    engine = Engine()
    engine.submit("a", [1, 3, 4])
    engine.submit("b", [1, 3, 5], max_tokens=1)  # its first token ends it
    plan = prefill_all(engine)
    assert [s.request_id for s in engine.states.rows(plan.batch.rows)] == ["a"]  # "b" ended with its prefill
    engine.states.abort({"a": "stop"})  # the text matched a stop string: the front end aborts with "stop"
    engine.states.deliver()
    assert [e.finish_reason for e in engine.events["a"]] == [None, "stop"]
    assert [e.finish_reason for e in engine.events["b"]] == ["length"]
    assert engine.scheduler.idle and sorted(engine.scheduler.free) == [0, 1, 2, 3]


def test_the_prefix_a_finished_request_wrote_is_held_once_by_its_slot_and_matched_by_the_next_prompt():
    engine = Engine(prefix=True)
    prompt = list(range(10, 10 + 2 * BLOCK + 3))
    a = engine.submit("a", prompt)
    plan = prefill_all(engine)
    engine.states.update_from_output(plan.batch, [a], output([8]))
    engine.states.abort({"a": "abort"})
    written = prompt + [7]  # every token but the last: the last one's keys were never computed
    assert engine.scheduler.prefix.holders(written) == [0]
    b = engine.submit("b", written + [5])
    plan = engine.scheduler.schedule()
    assert plan.prefills == [Prefill("b", 0, len(written) + 1, 2 * BLOCK, False)]  # whole blocks of it cached
    assert b.cached == 2 * BLOCK and b.slot == 0


def test_a_failed_call_leaves_its_slots_out_of_the_prefix_cache():
    engine = Engine(prefix=True)
    prompt = list(range(10, 10 + 2 * BLOCK))
    engine.submit("a", prompt)
    prefill_all(engine)
    engine.states.fail_running(RuntimeError("the core failed"))
    engine.states.deliver()
    assert engine.events["a"][-1].error == "RuntimeError: the core failed"
    assert engine.scheduler.prefix.holders(prompt) == []


def test_accepted_and_rejected_proposals_are_counted_and_the_round_takes_the_models_tokens():
    engine = Engine()
    a = engine.submit("a", [1, 3, 4])
    b = engine.submit("b", [1, 3, 5])
    plan = prefill_all(engine)
    # "a" proposed 5, 6, 7: the model agreed on 5 and 6, chose 9 over 7. "b" proposed 4: rejected, the model's 3.
    engine.states.update_from_output(plan.batch, [a, b], output([5, 6, 9], [3], proposals=[[5, 6, 7], [4]]))
    assert a.output == [7, 5, 6, 9] and b.output == [7, 3]
    assert engine.counted("neuron_serve_spec_decode_num_drafts") == 2
    assert engine.counted("neuron_serve_spec_decode_num_draft_tokens") == 4
    assert engine.counted("neuron_serve_spec_decode_num_accepted_tokens") == 2


def test_a_round_stops_at_a_rows_end_even_with_tokens_left():
    engine = Engine()
    a = engine.submit("a", [1, 3, 4])
    plan = prefill_all(engine)
    engine.states.update_from_output(plan.batch, [a], output([5, EOS, 6], proposals=[[5, EOS, 6]]))
    assert a.output == [7, 5, EOS] and a.finish_reason == "stop"


class CoreBuffers:
    """The core's LoRA buffers, which this test has no core for: it records the adapters written into a slot."""

    def __init__(self) -> None:
        self.written: list[int] = []

    def write_adapter(self, index: int, adapter) -> None:
        self.written.append(index)


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    make_adapter(root / "one", r=4, lora_alpha=8, target_modules=ATTENTION)
    policy = AdapterPolicy(LoraBase.of(gm.build("llama")), max_loras=1, max_lora_rank=4, max_cpu_loras=1)
    return root, policy


def test_a_finished_requests_adapter_buffer_slot_goes_back_and_an_unloaded_adapter_goes_with_its_last_request(
        adapters):
    root, policy = adapters
    held = Adapters(CoreBuffers(), policy)
    held.add("one", root / "one")
    engine = Engine(adapters=held)
    a = engine.submit("a", [1, 3, 4], adapter="one")
    b = engine.submit("b", [1, 3, 5], adapter="one")
    plan = prefill_all(engine)
    assert [call.adapter_slot for call in plan.admitted] == [1, 1] and held.resident == {"one": 1}
    held.unload("one")  # both were taken on it: it retires, and they finish on it
    assert "one" not in held and held.resident == {"one": 1}
    engine.states.update_from_output(plan.batch, [a, b], output([EOS], [5]))
    assert "one" in held.paths  # "b" still runs on it
    engine.states.abort({"b": "abort"})
    assert "one" not in held.paths and held.resident == {}
    assert a.adapter_slot is None and b.adapter_slot is None
