"""``decode_steps``: several greedy decode steps in one compiled call, on real transformers LMs.

The tokens must be transformers' own greedy tokens, whatever step of a call a sequence
ends in (length, a stop token; EOS in test_generation_engine); a call runs several steps only while every running
sequence is greedy, has room for them, and no prompt could start meanwhile.
"""

from __future__ import annotations

import pytest
import torch

import generation_models as gm
from neuron_serve.config.schema import parse_config
from neuron_serve.errors import ConfigError
from neuron_serve.generation import GenerationBuckets, SamplingParams, engine_for

STEPS = 4
# Four slots for five prompts (the fifth waits for a slot); no new-token count a multiple of STEPS.
PROMPT_LENGTHS = (3, 11, 20, 7, 30)
NEW_TOKENS = (12, 5, 20, 9, 15)
SHAPES = {"max_num_seqs": 4, "max_model_len": 48, "prefill_buckets": [16, 48], "decode_batch_buckets": [1, 4],
          "decode_context_buckets": [24, 48]}


def prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(0, gm.VOCAB, (n,), generator=generator).tolist() for n in PROMPT_LENGTHS]


def greedy(n: int | None, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, **kw)


class Calls:
    """The steps of every decode call the engine makes (recorded around the model's decode)."""

    def __init__(self, engine) -> None:
        self.model, self.steps = engine.engines.model, []
        decode = self.model.decode

        def recording(tokens, positions, slots, steps=1, choices=None, feed=None):
            out, shape = decode(tokens, positions, slots, steps, choices, feed)
            self.steps.append(shape.steps)
            return out, shape

        self.model.decode = recording

    def __enter__(self) -> "Calls":
        return self

    def __exit__(self, *exc) -> None:
        del self.model.decode


@pytest.fixture(scope="module")
def llama():
    lm = gm.build("llama")
    # A step's prompt tokens within 16: the third prompt waits with a slot free, and the calls meanwhile are single steps.
    engine = engine_for(lm, **SHAPES, decode_steps=STEPS, max_num_batched_tokens=16)
    yield lm, engine
    engine.close()


def test_greedy_equals_transformers_when_sequences_end_inside_a_call(llama):
    lm, engine = llama
    want = [gm.eager_greedy(lm, p, n) for p, n in zip(prompts(), NEW_TOKENS)]  # 12, 5, 20, 9, 15 tokens
    with Calls(engine) as calls:
        done = engine.generate_batch(prompts(), [greedy(n) for n in NEW_TOKENS])
    assert [d.tokens for d in done] == want
    assert [d.finish_reason for d in done] == ["length"] * len(want)
    assert STEPS in calls.steps and 1 in calls.steps  # single steps while the fifth prompt waited for a slot
    # Far fewer calls than tokens: 61 tokens, the first of each from its prefill.
    assert len(calls.steps) < sum(NEW_TOKENS) - len(NEW_TOKENS)
    assert engine.running == 0


def test_a_stop_token_inside_a_call_ends_the_sequence_there(llama):
    lm, engine = llama
    prompt = prompts()[1]
    want = gm.eager_greedy(lm, prompt, 20)
    stop_id = want[6]
    first = want.index(stop_id)
    with Calls(engine) as calls:
        [done] = engine.generate_batch([prompt], greedy(20, stop_token_ids=(stop_id,)))
    assert (done.tokens, done.finish_reason, done.stop_reason) == (want[:first + 1], "stop", stop_id)
    assert set(calls.steps) == {STEPS}


def test_the_last_positions_of_the_context_run_one_step_a_call(llama):
    lm, engine = llama
    prompt = prompts()[4]  # 30 tokens: calls at positions 30, 34, 38, 42; at 46 only two positions are left
    with Calls(engine) as calls:
        [full] = engine.generate_batch([prompt], greedy(None))  # until the context is full
    assert (len(prompt) + len(full.tokens), full.finish_reason) == (SHAPES["max_model_len"], "length")
    assert full.tokens == gm.eager_greedy(lm, prompt, 18)
    assert calls.steps == [STEPS] * 4 + [1]


def test_sampled_requests_take_several_steps_a_call_and_the_tokens_of_one_at_a_time(llama):
    """Each step samples with its token's index: the tokens of eager sampling, token for token, whatever
    else runs beside them; a request whose tokens need the host (logprobs) makes every call one step."""
    lm, engine = llama
    seeded = [SamplingParams(max_tokens=13, temperature=0.9, top_p=0.9, seed=7),
              SamplingParams(max_tokens=11, temperature=1.0, top_k=20, min_p=0.01, seed=8)]
    with Calls(engine) as calls:
        done = engine.generate_batch([prompts()[0], prompts()[1], prompts()[2]], [*seeded, greedy(6)])
    assert [d.tokens for d in done[:2]] == [gm.eager_sampled(lm, p, 13 if i == 0 else 11, s)
                                            for i, (p, s) in enumerate(zip(prompts(), seeded))]
    assert done[2].tokens == gm.eager_greedy(lm, prompts()[2], 6)
    assert STEPS in calls.steps
    with Calls(engine) as calls:
        [scored] = engine.generate_batch([prompts()[1]], greedy(6, logprobs=0))
    assert set(calls.steps) == {1} and len(scored.logprobs) == 6 and None not in scored.logprobs


def test_each_decode_bucket_is_compiled_once_per_call_form(llama):
    _, engine = llama
    labels = [s.label for s in engine.engines.model.shapes]
    assert "decode_4x48" in labels and f"decode_4x48_steps{STEPS}" in labels
    assert "decode_4x48_sampled" in labels and f"decode_4x48_steps{STEPS}_sampled" in labels
    # Two prefill buckets; each of the four decode buckets greedy and sampled, one step and STEPS.
    assert engine.engines.model.buckets.count == len(labels) == 2 + 4 * 2 * 2


@pytest.mark.parametrize("steps", [0, 17])
def test_decode_steps_out_of_range_is_refused_naming_the_field(steps):
    with pytest.raises(ConfigError, match=r"generation\.decode_steps"):
        parse_config({"name": "llm", "task": "generate", "model": {"pretrained": "llm"},
                          "generation": {"decode_steps": steps}})
    if steps:
        with pytest.raises(ConfigError, match=f"decode_steps: must be 1 \\(one token per call\\) to 16, got {steps}"):
            GenerationBuckets.build(4, 48, decode_steps=steps, field_prefix="")


def test_an_artifact_keeps_decode_steps_and_generates_the_same_tokens(llama, tmp_path):
    from neuron_serve.generation.compiling.artifact import load_generation, save_generation  # noqa: PLC0415
    from neuron_serve.generation.core.engine import Engine  # noqa: PLC0415
    from neuron_serve.generation.frontend.processor import Frontend  # noqa: PLC0415
    from neuron_serve.generation.core.group import describe  # noqa: PLC0415

    lm, engine = llama
    save_generation(engine.engines.model, tmp_path / "built", eos_token_ids=[])  # the engine is idle between tests
    model, _, _ = load_generation(tmp_path / "built")
    built = [s.label for s in engine.engines.model.shapes]
    assert model.decode_steps == STEPS and [s.label for s in model.shapes] == built
    core = Engine(model)
    loaded = Frontend(core, describe([core], 8))
    try:
        with Calls(loaded) as calls:
            [done] = loaded.generate_batch([prompts()[2]], greedy(9))
        assert done.tokens == gm.eager_greedy(lm, prompts()[2], 9)
        assert calls.steps == [STEPS, STEPS]  # the first token from the prefill, then 4 + 4
    finally:
        loaded.close()
