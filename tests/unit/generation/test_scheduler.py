"""The scheduler's policy (generation/core/scheduler.py), step by step, with no model: what each plan (data: request ids
and slots) holds under the token budget, without and with chunked prefill. ``Compiled`` says what the engine's compiled models take, as the
executor does (its chunk_capacity, can_score, rows_bucket, prefill_rows), so the plans are the ones an engine would get."""

from __future__ import annotations

from dataclasses import dataclass

from neuron_serve.generation.sample.sampling import SamplingParams
from neuron_serve.generation.core.request import Sequence
from neuron_serve.generation.core.plan import PrefillBatch
from neuron_serve.generation.core.scheduler import Scheduler


@dataclass
class Compiled:
    """Mixed models taking chunks of up to ``chunk`` tokens (0: none compiled); every prefill kind compiled."""

    chunk: int = 0
    prompts: tuple[int, ...] = (1,)  # prompt counts a prefill call takes

    def prefill_rows(self, length: int) -> list[int]:
        return list(self.prompts)

    def chunk_capacity(self, rows: int) -> int:
        return self.chunk

    def can_score(self, length: int) -> bool:
        return True

    def rows_bucket(self, rows: int) -> int:
        return 1 if rows <= 1 else 4


def _seq(name: str, length: int, **params) -> Sequence:
    return Sequence(name, list(range(1, length + 1)), SamplingParams(**params), lambda event: None)


def _seqs(scheduler: Scheduler) -> dict[str, Sequence]:
    return {s.request_id: s for s in [*scheduler.running.values(), *scheduler.waiting]}


def _run(scheduler: Scheduler, plan) -> None:
    """What the engine does with a plan, as far as the scheduler sees it: prompts written, a token each."""
    seqs = _seqs(scheduler)
    for call in plan.prefills:
        seq = seqs[call.request_id]
        scheduler.wrote(seq, len(seq.prompt))
        seq.output.append(0)
    if plan.chunk is not None:
        seq = seqs[plan.chunk.request_id]
        scheduler.wrote(seq, plan.chunk.start + plan.chunk.length)
        if plan.chunk.last:
            seq.output.append(0)
    for rid in plan.decode:
        if seqs[rid].output:
            seqs[rid].output.append(0)


def test_without_chunking_prompts_are_prefilled_whole_under_the_budget_in_the_lowest_slots():
    scheduler = Scheduler(slots=4, max_num_batched_tokens=100, models=Compiled())
    for name, length in [("a", 150), ("b", 40), ("c", 30), ("d", 50)]:
        scheduler.add(_seq(name, length))
    # The first waiting prompt always goes, even past the budget; then nothing more this step.
    plan = scheduler.schedule()
    assert [(p.request_id, p.slot) for p in plan.prefills] == [("a", 0)] and plan.chunk is None
    _run(scheduler, plan)
    plan = scheduler.schedule()
    assert [(p.request_id, p.slot) for p in plan.prefills] == [("b", 1), ("c", 2)]  # 70 of 100 tokens
    assert list(plan.decode) == ["a", "b", "c"]  # the ones just prefilled decode too
    _run(scheduler, plan)
    scheduler.release(scheduler.running[0])
    plan = scheduler.schedule()
    assert [(p.request_id, p.slot) for p in plan.prefills] == [("d", 0)]  # the freed low slot
    assert list(plan.decode) == ["d", "b", "c"]


def test_prompts_admitted_together_are_prefilled_together_longest_first_in_the_calls_compiled():
    scheduler = Scheduler(slots=8, max_num_batched_tokens=512, models=Compiled(prompts=(1, 4)))
    for name, length in [("a", 5), ("b", 30), ("c", 12), ("d", 7), ("e", 9), ("f", 3)]:
        scheduler.add(_seq(name, length))
    plan = scheduler.schedule()
    # Six prompts: a call of the longest four (it pads to the longest's bucket), the 2 left in a call of 4; the call
    # holding the first to arrive goes first.
    batches = [[p.request_id for p in call.prompts] for call in plan.calls if isinstance(call, PrefillBatch)]
    assert batches == [["a", "f"], ["b", "c", "e", "d"]]
    assert [a.request_id for a in plan.admitted] == ["a", "b", "c", "d", "e", "f"]
    assert plan.calls.index(plan.admitted[-1]) < plan.calls.index(next(c for c in plan.calls if isinstance(c, PrefillBatch)))
    assert list(plan.decode) == ["a", "b", "c", "d", "e", "f"] and plan.prompt_tokens == 66
    _run(scheduler, plan)
    scheduler.add(_seq("g", 4))
    plan = scheduler.schedule()  # one prompt: a call of its own
    assert [[p.request_id for p in c.prompts] for c in plan.calls if isinstance(c, PrefillBatch)] == [["g"]]


def test_with_chunking_decode_rows_go_first_and_one_chunk_fills_the_rest_of_the_budget():
    scheduler = Scheduler(slots=4, max_num_batched_tokens=20, models=Compiled(chunk=16), chunked=True)
    for name in ("a", "b"):
        scheduler.add(_seq(name, 3))
    plan = scheduler.schedule()  # nothing decodes yet: short prompts that fit go whole, as without chunking
    assert [p.request_id for p in plan.prefills] == ["a"] and plan.chunk is None  # one part way at a time
    _run(scheduler, plan)
    plan = scheduler.schedule()
    assert plan.prefills == [] and (plan.chunk.request_id, plan.chunk.start, plan.chunk.length) == ("b", 0, 3)
    _run(scheduler, plan)
    scheduler.add(_seq("long", 40))
    seen = []
    while any(s.prefilling for s in scheduler.running.values()) or scheduler.waiting:
        plan = scheduler.schedule()
        assert plan.prompt_tokens + len(plan.decode) <= 20  # the budget, every step
        seen.append((plan.chunk.start, plan.chunk.length, list(plan.decode)))
        _run(scheduler, plan)
    # 2 decode rows leave 18 tokens, and the largest compiled chunk takes 16.
    assert seen == [(0, 16, ["a", "b"]), (16, 16, ["a", "b"]), (32, 8, ["a", "b"])]
    assert [s.request_id for s in scheduler.decoding()] == ["a", "b", "long"]


def test_long_prefill_token_threshold_caps_a_chunk_and_the_shortest_prompt_part_way_goes_first():
    scheduler = Scheduler(slots=4, max_num_batched_tokens=64, models=Compiled(chunk=32), chunked=True,
                          long_prefill_token_threshold=10, max_num_partial_prefills=2)
    scheduler.add(_seq("running", 2))
    _run(scheduler, scheduler.schedule())
    scheduler.add(_seq("long", 50))
    scheduler.add(_seq("short", 12))
    plan = scheduler.schedule()  # both admitted (two may be part way); the one with fewest tokens left goes
    assert sorted(a.request_id for a in plan.admitted) == ["long", "short"]
    assert (plan.chunk.request_id, plan.chunk.length) == ("short", 10)
    _run(scheduler, plan)
    plan = scheduler.schedule()
    assert (plan.chunk.request_id, plan.chunk.start, plan.chunk.length) == ("short", 10, 2)
    _run(scheduler, plan)
    plan = scheduler.schedule()
    assert (plan.chunk.request_id, plan.chunk.start, plan.chunk.length) == ("long", 0, 10)


def test_a_prompt_asking_for_its_logprobs_and_any_prompt_before_a_mixed_model_compiles_go_whole():
    scheduler = Scheduler(slots=4, max_num_batched_tokens=16, models=Compiled(chunk=8), chunked=True,
                          max_num_partial_prefills=4)
    scheduler.add(_seq("running", 2))
    _run(scheduler, scheduler.schedule())
    scheduler.add(_seq("scored", 30, prompt_logprobs=0))
    plan = scheduler.schedule()
    assert [p.request_id for p in plan.prefills] == ["scored"] and plan.chunk is None
    _run(scheduler, plan)
    compiling = Scheduler(slots=4, max_num_batched_tokens=16, models=Compiled(chunk=0), chunked=True)
    compiling.add(_seq("running", 2))
    _run(compiling, compiling.schedule())
    compiling.add(_seq("long", 30))
    plan = compiling.schedule()
    assert [p.request_id for p in plan.prefills] == ["long"] and plan.chunk is None


def test_sequences_move_down_to_a_smaller_decode_bucket_only_when_no_prompt_is_part_way():
    scheduler = Scheduler(slots=4, max_num_batched_tokens=20, models=Compiled(chunk=8), chunked=True)
    for name in ("a", "b", "c"):
        scheduler.add(_seq(name, 2))
    for _ in range(3):
        _run(scheduler, scheduler.schedule())
    scheduler.release(scheduler.running[0])
    scheduler.release(scheduler.running[1])
    scheduler.add(_seq("long", 20))
    plan = scheduler.schedule()
    assert plan.moves == [] and plan.chunk is not None  # "long" is part way in slot 0
    while any(s.prefilling for s in scheduler.running.values()):
        _run(scheduler, plan)
        plan = scheduler.schedule()
    assert plan.moves == []  # "long" in slot 0 and "c" in slot 2: two rows, but slot 2 needs the 4-row bucket
    scheduler.release(scheduler.running[0])
    plan = scheduler.schedule()
    assert [(m.request_id, m.dst) for m in plan.moves] == [("c", 0)]
