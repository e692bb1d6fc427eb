"""A serving generate engine with ``prefill_buckets: auto`` and ``decode_batch_buckets: auto`` changes its own
buckets for those its traffic pads least: started on the defaults (nothing recorded yet), sent prompts of 5 and 8
tokens one at a time (greedy and sampled) while another replica's record says its decode calls ran 3 rows; every
answer equal to transformers' before, during and after both switches; the lists worked out here by hand, the number
of compiled models kept, and a restart starting on them."""

from __future__ import annotations

import time

import pytest
from prometheus_client import REGISTRY

import generation_models as gm
from log_lines import capture
from neuron_serve.buckets import usage as bucket_usage
from neuron_serve.compile import cache as compile_cache
from neuron_serve.config.generation import GenerationSettings
from neuron_serve.generation import SamplingParams, engine_for
from neuron_serve.generation.compiling.build import checked_buckets

NAME = "llm-rebucket"  # a name of its own: the counters are the process's
PROMPTS = [list(range(1, 6)), list(range(40, 48))]  # 5 and 8 tokens
GREEDY = SamplingParams(max_tokens=6, temperature=0)
SAMPLED = SamplingParams(max_tokens=6, temperature=0.8, top_p=0.9, seed=5)
SETTINGS = {"max_num_seqs": 4, "max_model_len": 48, "prefill_buckets": "auto", "decode_batch_buckets": "auto",
            "learn_buckets_after": 4, "decode_context_buckets": [48],
            "prefill_batch_buckets": [1]}  # a prompt a call: the models a switch adds are its family's alone
OTHER_ROWS = 100_000  # decode calls of 3 rows another replica recorded: they outweigh this one's single rows


def switches(family: str, outcome: str) -> float:
    return REGISTRY.get_sample_value("neuron_serve_bucket_switches_total", {
        "model": NAME, "replica": "0", "family": family, "outcome": outcome}) or 0.0


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    lm = gm.build("llama")
    # Eager first: while a compile runs, torch.export's tracer takes every module call of the process.
    want = {(i, kind): (gm.eager_greedy(lm, p, 6) if kind == "greedy" else gm.eager_sampled(lm, p, 6, SAMPLED))
            for i, p in enumerate(PROMPTS) for kind in ("greedy", "sampled")}
    store = compile_cache.configure(tmp_path_factory.mktemp("rebucket") / "cache")
    try:
        with capture() as lines:
            front = engine_for(lm, name=NAME, **SETTINGS)
            engine = front.engines
            build = engine.model.build
            before = {"prefill": list(build.buckets.prefill), "decode_rows": list(build.buckets.decode_rows),
                      "compiled": len(engine.model.shapes)}
            other = bucket_usage.Usage(NAME, "other", store.root)  # another replica's calls, kept when it stopped
            other.sizes.record("decode_rows", 3, OTHER_ROWS)
            other.save()
            answers: dict[str, list] = {"before": [], "during": [], "after": []}

            def ask(phase: str) -> None:
                for i, prompt in enumerate(PROMPTS):
                    for kind, params in (("greedy", GREEDY), ("sampled", SAMPLED)):
                        answers[phase].append(((i, kind), front.generate_batch([prompt], params)[0].tokens))

            try:
                ask("before")  # 4 prefills and 20 one-row decodes: both families' first looks are due
                deadline = time.monotonic() + 300
                while not all(r.switches for r in engine.rebucketings):
                    assert time.monotonic() < deadline, [r.describe() for r in engine.rebucketings]
                    ask("during")  # the engine answers while the new models compile
                for rebucketing in engine.rebucketings:  # a look after the switch keeps the buckets
                    rebucketing.thread.join()
                after = {"prefill": list(build.buckets.prefill), "decode_rows": list(build.buckets.decode_rows),
                         "compiled": len(engine.model.shapes)}
                ask("after")
                states = [r.describe() for r in engine.rebucketings]
                recorded = {family: engine.usage.counts(family) for family in ("prefill", "decode_rows")}
            finally:
                front.close()
        restarted = checked_buckets(lm, GenerationSettings(**SETTINGS), field_prefix="", name=NAME)
    finally:
        compile_cache.configure()
    return {"want": want, "answers": answers, "before": before, "after": after, "lines": lines, "states": states,
            "recorded": recorded, "restarted": restarted}


def best(counts: dict[int, int], largest: int) -> list[int]:
    """The two-bucket list, ``largest`` kept, that computes the fewest units for ``counts``: every choice tried."""
    first = min(range(1, largest), key=lambda b: (sum(n * (b if s <= b else largest) for s, n in counts.items()), b))
    return [first, largest]


def test_it_switches_both_families_to_the_buckets_that_pad_least_within_the_same_budget(run):
    assert run["before"] == {"prefill": [32, 48], "decode_rows": [1, 4], "compiled": 6}
    assert run["after"]["prefill"] == best(run["recorded"]["prefill"], 48) == [8, 48]
    assert run["after"]["decode_rows"] == best(run["recorded"]["decode_rows"], 4) == [3, 4]
    # 2 prefills, and decodes of 2 row counts at one context, greedy and sampled: 6 before, 6 after.
    assert run["after"]["compiled"] == 6
    for family in ("prefill", "decode_rows"):
        assert switches(family, "switched") == 1 and switches(family, "abandoned") == 0
    assert [s["switches"] for s in run["states"]] == [1, 1]


def test_every_answer_equals_transformers_before_during_and_after_the_switches(run):
    assert run["answers"]["during"], "no request was answered while the new buckets compiled"
    for phase, answered in run["answers"].items():
        for key, tokens in answered:
            assert tokens == run["want"][key], (phase, key)


def test_a_restart_starts_on_the_buckets_it_switched_to(run):
    assert (run["restarted"].prefill, run["restarted"].decode_rows) == (run["after"]["prefill"],
                                                                          run["after"]["decode_rows"])


def test_each_switch_is_logged(run):
    lines = run["lines"]
    assert any(line.startswith(f"model {NAME}: switching generation.prefill_buckets [32, 48] -> [8, 48] for the ")
               for line in lines), lines
    assert any(line.startswith(f"model {NAME}: now on generation.prefill_buckets [8, 48] (1 compiled in ")
               and " s, 5 kept); padded work " in line for line in lines), lines
    assert any(line.startswith(f"model {NAME}: now on generation.decode_batch_buckets [3, 4] (2 compiled in ")
               and " s, 4 kept); padded work " in line for line in lines), lines


def test_a_switch_whose_compile_fails_is_abandoned_and_the_old_buckets_serve_on(tmp_path):
    """Prompts of 16 tokens call for a 16-token prefill bucket, which this Llama cannot compile: the switch is
    abandoned (logged, counted, not tried again), the joined models are as before and the answers are eager's."""
    lm = gm.failing_llama()
    prompt = list(range(60, 76))
    want = gm.eager_greedy(lm, prompt, 4)
    compile_cache.configure(tmp_path / "cache")
    try:
        with capture() as lines:
            front = engine_for(lm, name="llm-rebucket-fails", max_num_seqs=1, max_model_len=48,
                               prefill_buckets="auto", learn_buckets_after=2, decode_context_buckets=[48],
                               on_device_sampling=False)
            engine = front.engines
            [look] = engine.rebucketings
            try:
                shapes = [s.label for s in engine.model.shapes]
                answers = [front.generate_batch([prompt], SamplingParams(max_tokens=4, temperature=0))[0].tokens
                           for _ in range(2)]
                look.thread.join()
                answers += [front.generate_batch([prompt], SamplingParams(max_tokens=4, temperature=0))[0].tokens
                            for _ in range(2)]
                look.thread.join()
                after = [s.label for s in engine.model.shapes]
            finally:
                front.close()
    finally:
        compile_cache.configure()
    assert answers == [want] * 4
    assert (look.current(), look.switches, look.abandoned) == ([32, 48], 0, {(16, 48)})
    assert after == shapes
    assert REGISTRY.get_sample_value("neuron_serve_bucket_switches_total", {
        "model": "llm-rebucket-fails", "replica": "0", "family": "prefill", "outcome": "abandoned"}) == 1.0
    abandoned = [line for line in lines if "abandoned" in line]
    assert len(abandoned) == 1, abandoned  # the second look does not compile it again
    assert abandoned[0].startswith("model llm-rebucket-fails: generation.prefill_buckets [16, 48] abandoned "
                                   "(NoKernelAtSixteen prefill_16 did not end: "), abandoned
    assert abandoned[0].endswith("; [32, 48] serve on"), abandoned


def test_a_model_yaml_replica_re_buckets_its_engines_too(tmp_path):
    """What a served replica's engine process builds (build.build_engine of a model.yaml, the background compile on):
    every engine of the group looks at the prompts, and the switch reaches each."""
    from pathlib import Path  # noqa: PLC0415

    from neuron_serve.config.schema import parse_config  # noqa: PLC0415
    from neuron_serve.generation.compiling.build import build_engine  # noqa: PLC0415

    lm = gm.build("llama")
    prompt = list(range(1, 6))
    want = gm.eager_greedy(lm, prompt, 4)
    config = parse_config({"name": "llm-rebucket-yaml", "task": "generate",
                           "model": {"factory": "generation_models:build", "kwargs": {"arch": "llama"}},
                           "generation": {"max_num_seqs": 2, "max_model_len": 48, "prefill_buckets": "auto",
                                          "learn_buckets_after": 2, "decode_context_buckets": [48],
                                          "on_device_sampling": False}})
    compile_cache.configure(tmp_path / "cache")
    try:
        front = build_engine(config, Path(__file__).resolve().parents[2], background=True)
        try:
            engines = front.engines.engines
            [look] = engines[0].rebucketings
            assert all(e.rebucketings == [look] for e in engines) and look.family == "prefill"
            assert front.engines.build.wait(300)
            answers = [front.generate_batch([prompt], SamplingParams(max_tokens=4, temperature=0))[0].tokens
                       for _ in range(2)]
            look.thread.join()
            answers.append(front.generate_batch([prompt], SamplingParams(max_tokens=4, temperature=0))[0].tokens)
            buckets = [e.model.buckets.prefill for e in engines]
        finally:
            front.close()
    finally:
        compile_cache.configure()
    assert answers == [want] * 3
    assert look.switches == 1 and buckets == [[5, 48]] * len(engines)
