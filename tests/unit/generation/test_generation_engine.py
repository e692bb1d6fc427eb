"""The generation engine on real transformers causal LMs (random weights), compiled through torch-xla.

Greedy generation must equal transformers' own ``generate(do_sample=False)`` token for
token while sequences of different lengths share decode calls and join and leave
mid-flight; every ending has its finish reason; the cache never leaves the core.
"""

from __future__ import annotations

import asyncio
import gc
import inspect
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import torch_xla.debug.metrics as xla_metrics

import generation_models as gm
from neuron_serve.errors import ConfigError, InvalidInput, Overloaded, UnsupportedModelError
from neuron_serve.generation import SamplingParams, engine_for

ROOT = Path(__file__).resolve().parents[3]
# Four slots for five prompts: the fifth joins when the first to end leaves its slot.
PROMPT_LENGTHS = (3, 11, 20, 7, 30)
NEW_TOKENS = (12, 5, 20, 9, 15)
SHAPES = {"max_num_seqs": 4, "max_model_len": 48, "prefill_buckets": [16, 48], "decode_batch_buckets": [1, 4],
          "decode_context_buckets": [24, 48]}
# Tests of greedy requests only: each decode bucket compiled by argmax alone (on_device_sampling: false).
GREEDY_SHAPES = {**SHAPES, "on_device_sampling": False}


def prompts(vocab: int = gm.VOCAB, lengths=PROMPT_LENGTHS, seed: int = 1) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=generator).tolist() for n in lengths]


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, **kw)


@pytest.fixture(scope="module")
def llama():
    lm = gm.build("llama")
    engine = engine_for(lm, **SHAPES)
    yield lm, engine
    engine.close()


@pytest.mark.parametrize("arch", sorted(gm.CONFIGS))
def test_greedy_equals_transformers_with_sequences_joining_and_leaving(arch):
    lm = gm.build(arch)
    engine = engine_for(lm, **GREEDY_SHAPES)
    try:
        want = [gm.eager_greedy(lm, p, n) for p, n in zip(prompts(), NEW_TOKENS)]
        done = engine.generate_batch(prompts(), [greedy(n) for n in NEW_TOKENS])
        assert [d.tokens for d in done] == want
        assert [d.finish_reason for d in done] == ["length"] * len(want)
        assert engine.running == 0
    finally:
        engine.close()


def test_sequences_left_above_a_smaller_decode_bucket_move_down_and_still_equal_transformers(llama):
    """The last sequence to end holds the highest slot; once it runs alone it moves to slot 0
    and decodes in the 1-row bucket, its tokens unchanged."""
    lm, engine = llama
    news = (3, 3, 3, 20)
    engine.generate_batch([prompts()[0]], greedy(1))  # the engine thread's own first move (its warm-up) is done
    model, moves, rows = engine.engines.model, [], []
    move, decode = model.move, model.decode

    def recording_move(src, dst):
        moves.append((src, dst))
        move(src, dst)

    def recording_decode(tokens, positions, slots, steps=1, choices=None, feed=None):
        out, shape = decode(tokens, positions, slots, steps, choices, feed)
        rows.append(shape.rows)
        return out, shape

    model.move, model.decode = recording_move, recording_decode
    try:
        done = engine.generate_batch(prompts()[:4], [greedy(n) for n in news])
    finally:
        del model.move, model.decode
    assert [d.tokens for d in done] == [gm.eager_greedy(lm, p, n) for p, n in zip(prompts()[:4], news)]
    assert moves == [(3, 0)]
    assert rows[:2] == [4, 4] and set(rows[3:]) == {1}, rows  # all four, then the one left, in the 1-row bucket


def test_a_slot_move_copies_the_cache_on_the_core(llama):
    _, engine = llama
    model = engine.engines.model
    before_cache = [t.cpu() for t in model.compiled.states]
    before = _transferred()
    model.move(1, 2)  # the engine's thread is idle between tests
    moved = _transferred() - before
    after = [t.cpu() for t in model.compiled.states]
    assert moved == 2 * 8  # the two slot indices; no cache bytes
    for old, new in zip(before_cache, after):
        assert torch.equal(new[2], old[1]) and torch.equal(new[:2], old[:2]) and torch.equal(new[3:], old[3:])


def test_a_seeded_request_gives_the_same_tokens_alone_and_in_a_batch(llama):
    _, engine = llama
    seeded = SamplingParams(max_tokens=10, temperature=0.9, top_p=0.9, top_k=50, seed=7)
    first = prompts()[0]
    alone = engine.generate_batch([first], seeded)[0].tokens
    others = [SamplingParams(max_tokens=8, temperature=1.0), greedy(6), SamplingParams(max_tokens=12, seed=3)]
    batch = engine.generate_batch([prompts()[1], first, prompts()[2], prompts()[3]], [others[0], seeded, *others[1:]])
    assert batch[1].tokens == alone
    unseeded = engine.generate_batch([first] * 3, SamplingParams(max_tokens=10, temperature=1.0))
    assert len({tuple(c.tokens) for c in unseeded}) > 1  # without a seed, each draws its own


def test_a_sampled_rows_logprobs_are_eager_log_softmax_of_its_tokens(llama):
    """A sampled request asking for logprobs: the same tokens as eager sampling from the same seed (its logits
    come home, where the host draws as the core would), and each token's logprob transformers' log-softmax at
    that position, within 1e-4."""
    lm, engine = llama
    prompt = prompts()[1]
    params = SamplingParams(max_tokens=8, temperature=0.8, top_p=0.9, seed=11, logprobs=0)
    [done] = engine.generate_batch([prompt, prompts()[2]], [params, SamplingParams(max_tokens=8, temperature=1.0)])[:1]
    assert done.tokens == gm.eager_sampled(lm, prompt, 8, params)
    with torch.no_grad():
        want = torch.log_softmax(lm(torch.tensor([prompt + done.tokens])).logits[0].float(), -1)
    at = [float(want[len(prompt) - 1 + i, token]) for i, token in enumerate(done.tokens)]
    assert done.logprobs == pytest.approx(at, abs=1e-4)


def _transferred() -> float:
    """Bytes moved between host and device, both ways, so far."""
    return sum((xla_metrics.metric_data(name) or (0, 0.0))[1] for name in ("InboundData", "OutboundData"))


def test_the_cache_never_leaves_the_core_during_decode(llama):
    """Per decode step only tokens and positions (and a sampled row's parameters) go in and one id a row
    (and whether the core chose it) comes out; the logits cross only when a row asks for them."""
    from neuron_serve.generation.sample.sampler import RowChoice

    _, engine = llama
    model = engine.engines.model
    smallest_cache = min(t.numel() * t.element_size() for t in model.compiled.states)
    model.decode([1, 2], [3, 4], [0, 1])[0].tokens  # warm-up
    before = _transferred()
    steps = 50
    for i in range(steps):
        out, shape = model.decode([1, 2], [5 + i % 10, 6], [0, 1])
        assert len(out.tokens) == 2
    per_step = (_transferred() - before) / steps
    # In: tokens, positions, last (int64 per row; a decode row is its slot); out: the chosen ids (int64 per row).
    assert per_step == shape.rows * 8 * 3 + shape.rows * 8, per_step
    assert per_step < smallest_cache  # not even one layer's keys crossed
    sampled = [RowChoice(temperature=0.8, top_p=0.9, seed=1, counter=3), RowChoice(temperature=1.0, top_k=5, seed=2)]
    model.decode([1, 2], [3, 4], [0, 1], choices=sampled)[0].tokens  # warm-up
    before = _transferred()
    for i in range(steps):
        out, shape = model.decode([1, 2], [5 + i % 10, 6], [0, 1], choices=sampled)
        assert len(out.tokens) == 2 and len(out.done) == 2
    per_step = (_transferred() - before) / steps
    # And the rows' sampling parameters (3 floats, 3 int32 a row) in, whether each token is final (a bool) out.
    assert per_step == shape.rows * 8 * 3 + shape.rows * 24 + shape.rows * 8 + shape.rows, per_step
    before = _transferred()
    out, shape = model.decode([1, 2], [5, 6], [0, 1])
    assert len(out.tokens) == 2 and out.logits.shape == (2, gm.VOCAB)
    # The same step's transfers and the logits, asked for.
    assert _transferred() - before == shape.rows * 8 * 3 + shape.rows * 8 + shape.rows * gm.VOCAB * 4


def test_many_steps_leave_no_tensor_behind_on_the_core(llama):
    _, engine = llama
    live = lambda: xla_metrics.counter_value("CreateXlaTensor") - xla_metrics.counter_value("DestroyXlaTensor")  # noqa: E731
    engine.generate_batch([prompts()[0]], greedy(4), timeout=60)  # warm-up
    gc.collect()
    before = live()
    engine.generate_batch(prompts()[:4], [greedy(30), greedy(20), greedy(15), greedy(10)], timeout=120)
    gc.collect()
    # About 35 steps: a tensor left per step would show as dozens; the last step's outputs may still be held.
    assert live() - before <= 2


def test_each_ending_has_its_finish_reason(llama):
    lm, engine = llama
    prompt = prompts()[1]
    want = gm.eager_greedy(lm, prompt, 20)
    stop_id = want[5]
    first = want.index(stop_id)
    [by_id] = engine.generate_batch([prompt], greedy(20, stop_token_ids=(stop_id,)))
    assert (by_id.tokens, by_id.finish_reason, by_id.stop_reason) == (want[:first + 1], "stop", stop_id)
    [by_length] = engine.generate_batch([prompt], greedy(4))
    assert (by_length.tokens, by_length.finish_reason) == (want[:4], "length")
    [full] = engine.generate_batch([prompt], greedy(None))  # until the context is full
    assert (len(prompt) + len(full.tokens), full.finish_reason) == (SHAPES["max_model_len"], "length")
    assert full.tokens[:20] == want


@pytest.mark.parametrize("decode_steps", [1, 4])  # with 4, the EOS is the third token of the first decode call
def test_eos_ends_a_sequence_unless_ignored(decode_steps):
    lm = gm.build("qwen2")
    prompt = prompts()[2]
    want = gm.eager_greedy(lm, prompt, 12)
    eos = want[3]
    lm.generation_config.eos_token_id = eos
    engine = engine_for(lm, **GREEDY_SHAPES, decode_steps=decode_steps)
    try:
        [ended] = engine.generate_batch([prompt], greedy(12))
        assert (ended.tokens, ended.finish_reason, ended.stop_reason) == (want[:want.index(eos) + 1], "stop", eos)
        [ignored] = engine.generate_batch([prompt], greedy(12, ignore_eos=True))
        assert (ignored.tokens, ignored.finish_reason) == (want, "length")
    finally:
        engine.close()


def test_a_stop_string_ends_the_sequence_and_is_cut_from_the_text(llama, byte_tokenizer):
    lm, engine = llama
    engine.tokenizer = byte_tokenizer
    try:
        prompt = prompts()[0]
        want = gm.eager_greedy(lm, prompt, 20)
        text = byte_tokenizer.decode(want)
        # Two printable ASCII characters past the start (random bytes also decode to U+FFFD, not text to stop on).
        stop = next(text[i:i + 2] for i in range(4, len(text) - 1) if text[i:i + 2].isascii() and text[i:i + 2].isprintable())
        at = text.index(stop)
        [done] = engine.generate_batch([prompt], greedy(20, stop=(stop,)))
        assert (done.finish_reason, done.stop_reason, done.text) == ("stop", stop, text[:at])
        assert byte_tokenizer.decode(done.tokens).find(stop) == at  # it ended on the token completing it
        assert stop not in byte_tokenizer.decode(done.tokens[:-1])
    finally:
        engine.tokenizer = None


def test_an_abort_frees_the_slot_at_the_next_step(llama):
    _, engine = llama
    events = []

    async def stream_then_leave():
        async for event in engine.generate(prompts()[0], greedy(40)):
            events.append(event)
            if len(events) == 3:
                break  # the client goes away

    asyncio.run(stream_then_leave())
    [after] = engine.generate_batch([prompts()[1]], greedy(2), timeout=60)  # the engine keeps serving
    assert after.finish_reason == "length"
    assert engine.running == 0 and len(engine.engines.scheduler.free) == SHAPES["max_num_seqs"]
    assert len(events) == 3


def test_a_request_past_its_timeout_is_aborted_and_its_slot_freed():
    """Waiting or running, a request still open request_timeout_s after it arrived ends with
    finish_reason "abort" and timed_out; the slot goes back and the engine keeps serving."""
    lm = gm.build("llama")
    engine = engine_for(lm, **GREEDY_SHAPES, request_timeout_s=0.3)
    events: dict[str, list] = {}

    def slow(event):  # runs on the engine thread: every step takes at least 20 ms
        events.setdefault(event.request_id, []).append(event)
        time.sleep(0.02)

    try:
        ids = [engine.submit(prompts()[0], greedy(40), slow) for _ in range(SHAPES["max_num_seqs"] + 1)]
        deadline = time.time() + 30
        while not all(events.get(rid) and events[rid][-1].finished for rid in ids) and time.time() < deadline:
            time.sleep(0.01)
        for rid in ids:
            last = events[rid][-1]
            assert (last.finish_reason, last.timed_out) == ("abort", True), rid
            assert last.error.startswith("the request timed out: it was not finished 0.3s after it arrived")
            assert last.completion_tokens < 40
        assert events[ids[-1]][-1].completion_tokens == 0  # it never left the queue
        assert engine.running == 0 and len(engine.engines.scheduler.free) == SHAPES["max_num_seqs"]
        engine.engines.request_timeout_s = None
        [after] = engine.generate_batch([prompts()[1]], greedy(3), timeout=60)
        assert after.finish_reason == "length" and len(after.tokens) == 3
    finally:
        engine.close()


def test_metrics_name_the_model_in_vllms_label(llama):
    from neuron_serve import metrics

    def tokens() -> float:
        return sum(s.value for m in metrics.GENERATION_TOKENS.collect() for s in m.samples
                   if s.name.endswith("_total") and s.labels == {"model_name": "model", "replica": "0"})

    _, engine = llama
    before = tokens()
    engine.generate_batch([prompts()[0]], greedy(3), timeout=60)
    assert tokens() - before == 3


def test_generate_batch_aborts_what_it_stops_waiting_for(llama):
    _, engine = llama
    with pytest.raises(TimeoutError, match=r"^generate_batch: not finished within 0\.001s; the unfinished requests "
                                           r"were aborted$"):
        engine.generate_batch([prompts()[0]], greedy(40), timeout=0.001)
    deadline = time.time() + 10
    while engine.running and time.time() < deadline:
        time.sleep(0.01)
    assert engine.running == 0


def test_a_cache_too_big_for_the_core_is_refused_before_compiling(monkeypatch):
    from neuron_serve.generation.compiling.build import weight_bytes
    from neuron_serve.partition.pipeline import CORE_MEMORY_ENV

    lm = gm.build("llama")
    monkeypatch.setenv(CORE_MEMORY_ENV, str(weight_bytes(lm) + 1024))
    with pytest.raises(ConfigError, match=r"^max_num_seqs: 4 slots of 48 positions need \d+ bytes of KV cache "
                                          r"\(\d+ per slot\) next to \d+ bytes of weights, more than the core's "
                                          r"\d+ bytes; at most 0 slot\(s\) fit\. Lower max_num_seqs or "
                                          r"max_model_len, or split the model over 2 cores with "
                                          r"tensor_parallel_size: 2\.$"):
        engine_for(lm, **GREEDY_SHAPES)


def test_abort_by_id_gives_a_last_event():
    lm = gm.build("llama")
    engine = engine_for(lm, **GREEDY_SHAPES)
    seen = []
    try:
        engine.submit(prompts()[0], greedy(40), seen.append, request_id="r1")
        while not seen:
            time.sleep(0.001)
        engine.abort("r1")
        [after] = engine.generate_batch([prompts()[1]], greedy(2))
        assert after.finish_reason == "length"
        assert seen[-1].finish_reason == "abort" and len(seen) < 40
        assert engine.running == 0
    finally:
        engine.close()


def test_requests_that_cannot_fit_are_refused_with_both_numbers(llama):
    _, engine = llama
    with pytest.raises(InvalidInput, match=r"^the prompt has 30 tokens and max_tokens is 20: 50 tokens, more than "
                                           r"max_model_len \(48\)\. Shorten the prompt or lower max_tokens\.$"):
        engine.submit(prompts()[4], greedy(20), print)
    with pytest.raises(InvalidInput, match="^the prompt is empty"):
        engine.submit([], greedy(2), print)
    with pytest.raises(InvalidInput, match=r"^prompt token id 256 is outside the vocabulary \(0 to 255\)\.$"):
        engine.submit([1, 256], greedy(2), print)
    with pytest.raises(InvalidInput, match="^temperature must be >= 0"):
        SamplingParams(temperature=-1)
    with pytest.raises(InvalidInput, match="^stop strings need a tokenizer"):
        engine.submit([1, 2], greedy(2, stop=("x",)), print)


def test_the_queue_is_bounded():
    lm = gm.build("gpt2")
    engine = engine_for(lm, **GREEDY_SHAPES, max_waiting=2)
    try:
        for i in range(SHAPES["max_num_seqs"]):  # fill the slots with long requests, one by one
            engine.submit(prompts()[0], greedy(40), lambda e: None)
            while engine.running <= i:
                time.sleep(0.001)
        engine.submit(prompts()[0], greedy(2), lambda e: None)
        engine.submit(prompts()[0], greedy(2), lambda e: None)
        with pytest.raises(Overloaded, match=r"^the generation queue is full \(2 requests waiting\); retry later\.$"):
            engine.submit(prompts()[0], greedy(2), lambda e: None)
    finally:
        engine.close()


class _SortedActivation(torch.nn.Module):
    def forward(self, x):
        return torch.sort(x, dim=-1).values


def test_an_operator_the_core_cannot_run_is_refused_naming_it():
    lm = gm.build("llama")
    lm.model.layers[0].mlp.act_fn = _SortedActivation()
    line = inspect.getsourcelines(_SortedActivation.forward)[1] + 1
    with pytest.raises(UnsupportedModelError) as refused:
        engine_for(lm, **GREEDY_SHAPES)
    assert str(refused.value).splitlines() == [
        "The model has 1 operator(s) that target 'neuron' cannot run:",
        f"  aten::sort at test_generation_engine.py({line}): return torch.sort(x, dim=-1).values: neuronx-cc does not "
        "support sort",
        "Generation runs every operator on the NeuronCore, where the KV cache lives; replace the operator (or serve the "
        "model with task: infer).",
    ]


@pytest.fixture(scope="module")
def byte_tokenizer():
    return gm.byte_tokenizer()


def test_a_failing_event_sink_aborts_its_request_and_the_engine_keeps_serving(llama):
    _, engine = llama

    def broken(event):
        raise RuntimeError("the client's own code failed")

    engine.submit(prompts()[0], greedy(30), broken)
    [after] = engine.generate_batch([prompts()[1]], greedy(3), timeout=60)
    assert after.finish_reason == "length"
    deadline = time.time() + 10
    while engine.running and time.time() < deadline:
        time.sleep(0.01)
    assert engine.running == 0


def test_a_steps_tokens_reach_their_sinks_while_the_next_model_call_computes(llama, monkeypatch):
    # The event loop that streams them then holds the GIL while the core computes, not
    # while the engine prepares its next call: a call returns once the core has it, and
    # the events go out before its tokens are read. Only the events of the last step, with
    # no call after them, are handed over once the engine is idle. A prefill's first
    # token is handed over at once, before the decode call of its own step is prepared.
    lm, engine = llama
    decodes = [0]
    computing: set[int] = set()  # decode calls launched whose tokens are not read yet
    decode = engine.engines.model.decode

    def counted(*args, **kwargs):
        decodes[0] += 1
        out, shape = decode(*args, **kwargs)
        key = id(out._outputs)
        computing.add(key)
        home = out._outputs.home

        def read():
            computing.discard(key)
            return home()

        out._outputs.home = read
        return out, shape

    monkeypatch.setattr(engine.engines.model, "decode", counted)
    seen: list[tuple[int | None, bool, bool, int]] = []  # (token, finished, while a call computes, decodes begun)
    done = threading.Event()

    def sink(event):
        seen.append((event.token, event.finished, bool(computing), decodes[0]))
        if event.finished:
            done.set()

    engine.submit(prompts()[0], greedy(6), sink)
    assert done.wait(60)
    assert [token for token, _, _, _ in seen] == gm.eager_greedy(lm, prompts()[0], 6)
    assert [inside for _, _, inside, _ in seen] == [False] + [True] * 4 + [False]
    assert seen[0][3] == 0  # the first token went out before any decode call began


def test_an_engine_per_core_each_with_its_own_cache():
    """Two emulated cores (a fresh process): requests spread over both engines, every answer right, prompt
    logprobs asked of both at once too (their model compiles once, on the compile queue), a switch of prefill
    buckets reaching both; LoRA adapters on both engines, sampled and greedy rows alike."""
    env = {**os.environ, "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "2", "PYTHONWARNINGS": "ignore",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), str(ROOT)])}
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "generation_cores_check.py")], capture_output=True,
                          text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["equal"] == [True] * 8
    assert result["devices"] == ["xla:0", "xla:1"]
    # Each request goes to the engine with the most free slots: eight at once split evenly,
    # and with three long requests on core 0, the next three all go to core 1.
    assert result["served"] == [4, 4], result["served"]
    assert result["routed"] == [1, 1, 1], result["routed"]
    assert result["scored"] == [True] * 4
    # A switch of prefill buckets while serving reaches both engines: each drops prefill 16 for 8 (one compiled,
    # the other models kept), and greedy and sampled rows on both answer as transformers does after it.
    assert result["rebucketed"]["prefill"] == [["prefill_8", "prefill_48", "prefill_4x8"]] * 2
    assert result["rebucketed"]["buckets"] == [[8, 48]] * 2
    assert (result["rebucketed"]["compiled"], result["rebucketed"]["equal"]) == (2, [True] * 8)
    # LoRA over both engines: 8 sampled and greedy rows over two adapters and the base, then 4 sampled rows of an
    # adapter loaded on the group, each its PEFT model's; both engines wrote adapters into their buffers.
    assert result["lora"]["equal"] == [True] * 12
    assert all(written >= 1 for written in result["lora"]["written"])
