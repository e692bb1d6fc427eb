"""Async scheduling (vLLM's): while only the running rows' decode is to be done, each engine step launches the next
decode from the last one's tokens on the core before it reads them. Rows then end one call late: that call's token
for them is dropped, never sent. Every answer here is transformers' own (greedy) or the one the same engine gives
with the async scheduling off (seeded sampling, a token the host chose otherwise than the core)."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from prometheus_client import REGISTRY

import generation_models as gm
from neuron_serve.errors import ConfigError
from neuron_serve.generation import SamplingParams, engine_for

NAME = "async-scheduling"
SHAPES = {"max_num_seqs": 4, "max_model_len": 64, "prefill_buckets": [16, 64], "decode_batch_buckets": [1, 4],
          "decode_context_buckets": [32, 64]}


def prompts(lengths, seed: int = 21) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, gm.VOCAB, (n,), generator=generator).tolist() for n in lengths]


def counted(name: str) -> float:
    return REGISTRY.get_sample_value(f"neuron_serve_generation_{name}_total",
                                     {"model_name": NAME, "replica": "0"}) or 0.0


def idle_within(front, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while front.engines.running and time.monotonic() < deadline:
        time.sleep(0.05)
    return front.engines.running == 0


@pytest.fixture(scope="module")
def served():
    lm = gm.build("llama")
    front = engine_for(lm, name=NAME, async_scheduling=True, **SHAPES)  # on emulated cores it is off unless asked
    yield lm, front
    front.close()


@pytest.fixture
def synchronous(served):
    """The same engine with its async scheduling off for the test (each decode read before the next)."""
    engine = served[1].engines
    engine.async_scheduling = False
    yield
    engine.async_scheduling = True


def test_true_is_refused_where_no_decode_feeds_the_next():
    lm = gm.build("llama")
    with pytest.raises(ConfigError, match=r"^async_scheduling: feeds each one-step decode's tokens to the next on "
                                          r"the core, and decode_steps > 1 does not decode that way; set it false "
                                          r"or leave it unset$"):
        engine_for(lm, name="async-refused", decode_steps=4, async_scheduling=True, **SHAPES)


def test_greedy_rows_joining_and_leaving_equal_transformers_with_decodes_launched_ahead(served):
    """Six prompts over four slots: rows end by max_tokens, by a stop token in the middle of their run and on
    their first token, and the waiting prompts take the freed slots; no token after a stop, counts exact."""
    lm, front = served
    assert front.engines.async_scheduling
    asked = prompts((5, 12, 9, 3, 14, 7))
    want = [gm.eager_greedy(lm, p, 12) for p in asked]
    params = [SamplingParams(max_tokens=12, temperature=0),
              SamplingParams(max_tokens=12, temperature=0, stop_token_ids=[want[1][5]]),
              SamplingParams(max_tokens=3, temperature=0),
              SamplingParams(max_tokens=12, temperature=0, stop_token_ids=[want[3][0]]),
              SamplingParams(max_tokens=10, temperature=0),
              SamplingParams(max_tokens=12, temperature=0, stop_token_ids=[want[5][8]])]
    ahead, dropped = counted("decodes_ahead"), counted("decode_rows_ahead_dropped")
    done = front.generate_batch(asked, params, timeout=300)
    stop1, stop5 = want[1].index(want[1][5]) + 1, want[5].index(want[5][8]) + 1
    assert [d.tokens for d in done] == [want[0], want[1][:stop1], want[2][:3], want[3][:1], want[4][:10],
                                        want[5][:stop5]]
    assert [d.finish_reason for d in done] == ["length", "stop", "length", "stop", "length", "stop"]
    assert counted("decodes_ahead") - ahead >= 8  # most decodes launched ahead
    assert counted("decode_rows_ahead_dropped") > dropped  # the rows ending on a stop token had one more made
    assert front.engines.running == 0 and front.engines.free_slots == 4


def test_every_event_has_exact_counts_and_none_follows_the_last(served):
    lm, front = served
    prompt = prompts((8,), seed=22)[0]
    want = gm.eager_greedy(lm, prompt, 9)
    seen, finished = [], threading.Event()

    def sink(event):
        seen.append(event)
        if event.finished:
            finished.set()

    front.submit(prompt, SamplingParams(max_tokens=9, temperature=0, stop_token_ids=[want[6]]), sink)
    assert finished.wait(120)
    end = want.index(want[6]) + 1
    assert [e.token for e in seen] == want[:end]
    assert [e.completion_tokens for e in seen] == list(range(1, end + 1))
    assert (seen[-1].finish_reason, seen[-1].stop_reason) == ("stop", want[6])
    assert sum(e.finished for e in seen) == 1


def test_a_stop_string_ends_the_row_on_the_token_completing_it_and_nothing_after_is_sent(served):
    lm, front = served
    tokenizer = gm.byte_tokenizer()
    front.tokenizer = tokenizer
    try:
        prompt = prompts((7,), seed=27)[0]
        want = gm.eager_greedy(lm, prompt, 24)
        text = tokenizer.decode(want)
        # Two printable ASCII characters past the start (random bytes also decode to U+FFFD, not text to stop on).
        stop = next(text[i:i + 2] for i in range(4, len(text) - 1)
                    if text[i:i + 2].isascii() and text[i:i + 2].isprintable())
        seen, finished = [], threading.Event()

        def sink(event):
            seen.append(event)
            if event.finished:
                finished.set()

        front.submit(prompt, SamplingParams(max_tokens=24, temperature=0, stop=(stop,)), sink)
        assert finished.wait(120)
    finally:
        front.tokenizer = None
    tokens = [e.token for e in seen if e.token is not None]
    assert (seen[-1].finish_reason, seen[-1].stop_reason) == ("stop", stop)
    assert "".join(e.text for e in seen) == text[:text.index(stop)]
    assert tokens == want[:len(tokens)] and stop in tokenizer.decode(tokens)
    assert stop not in tokenizer.decode(tokens[:-1])  # it ended on the token completing it, none after
    assert [e.completion_tokens for e in seen] == list(range(1, len(seen) + 1))
    assert sum(e.finished for e in seen) == 1
    # The frontend finds the stop string and sends the finished event before the engine takes its abort: the slot
    # is freed at the engine's next step, not necessarily by the time the sink has run.
    assert idle_within(front, 30)


def test_prompts_arriving_while_others_decode_equal_transformers(served):
    """A prompt arriving reads the decode under way first (it is prefilled at once, not a call late); the rows
    decoding go on from their tokens."""
    lm, front = served
    asked = prompts((6, 11, 4), seed=23)
    want = [gm.eager_greedy(lm, p, 16) for p in asked]
    results: dict[int, list] = {i: [] for i in range(3)}
    ends = [threading.Event() for _ in range(3)]
    started = threading.Event()

    def sink(i):
        def take(event):
            if event.token is not None:
                results[i].append(event.token)
            if len(results[0]) == 4:
                started.set()
            if event.finished:
                ends[i].set()
        return take

    front.submit(asked[0], SamplingParams(max_tokens=16, temperature=0), sink(0))
    assert started.wait(120)
    for i in (1, 2):
        front.submit(asked[i], SamplingParams(max_tokens=16, temperature=0), sink(i))
    assert all(end.wait(120) for end in ends)
    assert [results[i] for i in range(3)] == want


def test_seeded_sampled_rows_take_the_tokens_they_take_without_it(served, request):
    _, front = served
    asked = prompts((7, 10, 4), seed=24)
    params = [SamplingParams(max_tokens=10, temperature=0.8, top_p=0.9, seed=300 + i) for i in range(3)]
    ahead = counted("decodes_ahead")
    together = [d.tokens for d in front.generate_batch(asked, params, timeout=300)]
    assert counted("decodes_ahead") > ahead
    request.getfixturevalue("synchronous")
    ahead = counted("decodes_ahead")
    assert [d.tokens for d in front.generate_batch(asked, params, timeout=300)] == together
    assert counted("decodes_ahead") == ahead  # off: no decode launched ahead


def test_a_token_the_host_chooses_otherwise_drops_the_decode_fed_the_cores(served):
    """min_tokens bans the stop token the model would take second: the host chooses another token than the
    core's argmax, which the decode launched ahead was fed; that row's token from it is dropped and the row decodes
    again from the host's token. The answer is the one without async scheduling."""
    lm, front = served
    prompt = prompts((9,), seed=25)[0]
    want = gm.eager_greedy(lm, prompt, 10)
    params = SamplingParams(max_tokens=10, temperature=0, stop_token_ids=[want[1]], min_tokens=2)
    dropped = counted("decode_rows_ahead_dropped")
    got = front.generate_batch([prompt], params, timeout=300)[0]
    assert counted("decode_rows_ahead_dropped") > dropped
    engine = front.engines
    engine.async_scheduling = False
    try:
        alone = front.generate_batch([prompt], params, timeout=300)[0]
    finally:
        engine.async_scheduling = True
    assert got.tokens == alone.tokens and got.tokens[1] != want[1]
    assert (got.finish_reason, got.stop_reason) == (alone.finish_reason, alone.stop_reason)


def test_an_abort_during_a_decode_launched_ahead_frees_its_slot(served):
    lm, front = served
    prompt, after = prompts((6, 8), seed=26)
    seen, finished = [], threading.Event()

    def sink(event):
        seen.append(event)
        if len(seen) == 3:
            front.abort(rid)
        if event.finished:
            finished.set()

    rid = front.submit(prompt, SamplingParams(max_tokens=40, temperature=0), sink)
    assert finished.wait(120)
    assert seen[-1].finish_reason == "abort" and len(seen) < 40
    tokens = [e.token for e in seen if e.token is not None]
    assert tokens == gm.eager_greedy(lm, prompt, len(tokens))
    assert front.engines.running == 0 and front.engines.free_slots == 4
    assert front.generate_batch([after], SamplingParams(max_tokens=6, temperature=0), timeout=300)[0].tokens == \
        gm.eager_greedy(lm, after, 6)
