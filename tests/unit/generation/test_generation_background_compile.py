"""Engines that start on the models answering every request while the rest compile on the compile queue:
answers equal eager transformers whichever models exist at that moment, a compile that fails is named
and counted and serving goes on, and a request that needs a model compiled on demand (prompt logprobs)
waits for it while the other streams go on."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from prometheus_client import REGISTRY

import generation_models as gm
from neuron_serve.buckets.generation import GenerationBuckets
from neuron_serve.generation import SamplingParams
from neuron_serve.generation.compiling.compile import GenerationBuild, ready_shapes
from neuron_serve.generation.core.engine import Engine
from neuron_serve.generation.frontend.processor import Frontend
from neuron_serve.generation.core.group import describe
from neuron_serve.generation.core.metrics import compile_listener

BUCKETS = GenerationBuckets.build(4, 48, prefill=[16, 48], decode_rows=[1, 4], decode_context=[48], field_prefix="")
PROMPTS = [[1, 2, 3, 4], [5, 6, 7, 8, 9, 10, 11], list(range(30, 50))]


SAMPLED = SamplingParams(max_tokens=10, temperature=0.8, top_p=0.9, seed=5)


@pytest.fixture(scope="module")
def started():
    """An engine on its start-up models; the build goes on behind it. The eager answers are computed first:
    while a compile runs, torch.export's tracer takes every module call of the process."""
    lm = gm.failing_llama()
    lm.want = ([gm.eager_greedy(lm, p, 10) for p in PROMPTS], [gm.eager_sampled(lm, p, 10, SAMPLED) for p in PROMPTS])
    build = GenerationBuild(lm, BUCKETS, name="staged")
    model = build.start(background=True)
    ready = [s.label for s in model.shapes]
    engine = Engine(model, name="staged")
    front = Frontend(engine, describe([engine], 8))
    yield lm, build, front, ready
    front.close()


def test_the_engine_starts_on_the_longest_prefill_and_the_largest_greedy_decode(started):
    _, build, _, ready = started
    assert ready == [s.label for s in ready_shapes(BUCKETS)] == ["prefill_48", "decode_4x48"]
    assert build.order[:2] == ready_shapes(BUCKETS)


def test_the_metrics_count_the_models_still_to_compile_from_the_start(started):
    """A replica's gauge is set when its listener is made, not at the first background compile's end: a scrape
    meanwhile sees the pending models (bench/servers.py waits on them)."""
    _, build, _, _ = started
    labels = {"model": "gauged", "replica": "0"}
    compile_listener("gauged", "0", build, True, lambda state: None)
    counts = {state: REGISTRY.get_sample_value("neuron_serve_compiled_models", {**labels, "state": state})
              for state in ("compiled", "pending", "failed")}
    assert None not in counts.values() and sum(counts.values()) == 6


def test_answers_equal_eager_whichever_models_exist_and_after_the_rest_compiled(started):
    lm, build, front, _ = started
    greedy_want, sampled_want = lm.want
    during = front.generate_batch(PROMPTS * 2, [SamplingParams(max_tokens=10, temperature=0)] * 3 + [SAMPLED] * 3)
    assert not build.finished.is_set()  # answered while models were still compiling
    assert [d.tokens for d in during] == greedy_want + sampled_want
    assert build.wait(600)
    after = front.generate_batch(PROMPTS * 2, [SamplingParams(max_tokens=10, temperature=0)] * 3 + [SAMPLED] * 3)
    assert [d.tokens for d in after] == greedy_want + sampled_want


def test_a_compile_that_fails_is_named_and_counted_and_the_engine_serves_on(started, caplog):
    lm, build, front, _ = started
    assert build.wait(600)
    counts = build.compiles.counts()
    assert (counts.compiled, counts.failed, counts.pending) == (5, 1, 0)
    [(label, reason)] = build.compiles.failures()
    assert label == "staged prefill_16"
    assert reason.startswith("UnsupportedModelError: torch.export cannot capture the model: NotImplementedError: "
                             "no kernel for 16 tokens a row at generation_models.py(")
    assert "prefill_16" not in [s.label for s in front.engines.model.shapes]
    # A 4-token prompt runs on the 48-token prefill instead: the same answer.
    [done] = front.generate_batch([PROMPTS[0]], SamplingParams(max_tokens=10, temperature=0))
    assert done.tokens == lm.want[0][0]


def test_a_prompt_logprobs_request_waits_for_its_model_while_another_stream_goes_on(started):
    """The prefill that keeps every position's logits compiles when first asked, on the compile queue: the
    engine's running stream keeps streaming meanwhile, and the scored request then runs."""
    lm, build, front, _ = started
    build.wait(600)
    times: list[float] = []
    long_done = threading.Event()

    def stream(event):
        if event.token is not None:
            times.append(time.perf_counter())
        if event.finished:
            long_done.set()

    front.submit(PROMPTS[1], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True), stream)
    while len(times) < 2:
        time.sleep(0.005)
    asked = time.perf_counter()
    [scored] = front.generate_batch([PROMPTS[2]], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0))
    answered = time.perf_counter()
    assert long_done.wait(120)
    assert any(asked < t < answered for t in times)  # the stream went on while the model compiled
    assert "prefill_48_every_position" in [s.label for s in front.engines.model.shapes]
    build.compiles.queue.wait(build.compiles.jobs())  # nothing traces while the eager reference runs
    with torch.no_grad():
        logits = lm(torch.tensor([PROMPTS[2]])).logits[0].float()
    want = torch.log_softmax(logits, -1)
    got = [None if p is None else p[0] for p in scored.prompt_logprobs]
    assert got[0] is None
    assert got[1:] == pytest.approx([float(want[i, PROMPTS[2][i + 1]]) for i in range(len(PROMPTS[2]) - 1)],
                                    abs=1e-4)
