"""A generate model's background compiles against a host memory budget: each one the budget cannot hold waits,
logged with its bucket and the bytes, then is skipped; the engine serves on the models it has, answers unchanged,
and nothing is killed. Each compiled model's host memory is measured as it compiles."""

from __future__ import annotations

import logging

import generation_models as gm
from neuron_serve.assembly import host_memory
from neuron_serve.buckets.generation import GenerationBuckets
from neuron_serve.generation import SamplingParams
from neuron_serve.generation.compiling.compile import GenerationBuild
from neuron_serve.generation.core.engine import Engine
from neuron_serve.generation.frontend.processor import Frontend
from neuron_serve.generation.core.group import describe

BUCKETS = GenerationBuckets.build(4, 48, prefill=[16, 48], decode_rows=[1, 4], decode_context=[48], field_prefix="")
PROMPTS = [[1, 2, 3, 4], list(range(30, 50))]
GREEDY = SamplingParams(max_tokens=8, temperature=0)


def test_compiles_the_budget_cannot_hold_are_skipped_and_the_engine_serves_on(monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="neuron_serve")
    lm = gm.build("llama")
    want = [gm.eager_greedy(lm, p, 8) for p in PROMPTS]
    build = GenerationBuild(lm, BUCKETS, name="budgeted")
    model = build.start(background=True)  # the start-up models, measured as they compile
    started = [job for job in build.compiles.jobs() if job.kind == "compile"]
    # (A graph this process's XLA compiled before, in another test, peaks at nothing: measured all the same.)
    assert len(started) == 2 and all(job.peak_bytes is not None and job.kept_bytes is not None for job in started)
    # From now on the process may hold less than it does: no compile fits.
    monkeypatch.setenv(host_memory.BUDGET_ENV, str(host_memory.resident_bytes() - (1 << 20)))
    monkeypatch.setenv(host_memory.WAIT_ENV, "1")
    engine = Engine(model, name="budgeted")  # queues the background compiles
    front = Frontend(engine, describe([engine], 8))
    try:
        assert [d.tokens for d in front.generate_batch(PROMPTS, GREEDY, timeout=300)] == want
        assert build.wait(300)
        assert [d.tokens for d in front.generate_batch(PROMPTS, GREEDY, timeout=300)] == want
    finally:
        front.close()
    skipped = build.compiles.failures()
    planned = [s.label for s in build.order[2:]]
    assert [label.removeprefix("budgeted ") for label, _ in skipped] == planned
    assert all(reason.startswith(f"HostMemoryExceeded: compile of {label} skipped: it needs about ")
               for label, reason in skipped)
    assert [s.label for s in model.shapes] == ["prefill_48", "decode_4x48"]  # served on what it had
    said = [r.getMessage() for r in caplog.records]
    for label in planned:
        assert any(m.startswith(f"compile of budgeted {label} deferred: it needs about ") and
                   f"GiB is left ({host_memory.BUDGET_ENV}=" in m for m in said), label
