"""Prompts arriving together are prefilled together: one compiled call of several prompts (prefill_batch_buckets),
compiled through torch-xla. Each prompt's answer is the one it gets alone (greedy: transformers' own; sampled: the
same tokens for its seed), whatever its length, its row in the call and the prompts beside it."""

from __future__ import annotations

import pytest
import torch
from prometheus_client import REGISTRY

import generation_models as gm
from neuron_serve.generation import SamplingParams, engine_for

NAME = "batched-prefill"
# Two prompt lengths; 2 and 4 prompts a call of 16 tokens (4 x 64 would pass max_model_len: not compiled).
SHAPES = {"max_num_seqs": 4, "max_model_len": 64, "prefill_buckets": [16, 64], "prefill_batch_buckets": [1, 2, 4],
          "decode_batch_buckets": [4], "decode_context_buckets": [64], "enable_prefix_caching": True}
LENGTHS = (3, 14, 9, 16, 5, 11)


def prompts(lengths=LENGTHS, seed: int = 7) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, gm.VOCAB, (n,), generator=generator).tolist() for n in lengths]


def calls(label: str) -> float:
    """Calls the engine made on the compiled model ``label`` so far."""
    return REGISTRY.get_sample_value("neuron_serve_generation_step_seconds_count",
                                     {"model_name": NAME, "replica": "0", "bucket": label}) or 0.0


@pytest.fixture(scope="module")
def served():
    lm = gm.build("llama")
    front = engine_for(lm, name=NAME, **SHAPES)
    yield lm, front
    front.close()


def test_the_compiled_prefills_are_each_length_alone_and_with_2_and_4_prompts_of_16(served):
    _, front = served
    labels = [s.label for s in front.engines.model.shapes if s.kind == "prefill"]
    assert labels == ["prefill_16", "prefill_64", "prefill_2x16", "prefill_4x16"]
    assert front.engines.async_scheduling is False  # unset, on emulated cores: each decode read before the next


def test_greedy_prompts_of_mixed_lengths_prefilled_together_equal_transformers(served):
    lm, front = served
    before = calls("prefill_4x16"), calls("prefill_2x16")
    asked = prompts()
    news = [6, 3, 9, 4, 1, 7]  # the 1-token request ends with its first token, in the batched call
    done = front.generate_batch(asked, [SamplingParams(max_tokens=n, temperature=0) for n in news], timeout=300)
    assert [d.tokens for d in done] == [gm.eager_greedy(lm, p, n) for p, n in zip(asked, news)]
    assert [len(d.tokens) for d in done] == news and [d.finish_reason for d in done] == ["length"] * 6
    # Four slots: the first four prompts in one call; the other two as slots free (alone or two together).
    assert calls("prefill_4x16") == before[0] + 1
    assert front.engines.running == 0


def test_each_request_s_queue_time_and_each_step_s_host_and_core_time_are_exported(served):
    _, front = served
    labels = {"model_name": NAME, "replica": "0"}

    def sample(name: str) -> float:
        return REGISTRY.get_sample_value(name, labels) or 0.0

    queued, host, core = (sample("neuron_serve_request_queue_time_seconds_count"),
                          sample("neuron_serve_generation_step_host_seconds_sum"),
                          sample("neuron_serve_generation_step_core_wait_seconds_sum"))
    steps = sample("neuron_serve_generation_step_host_seconds_count")
    front.generate_batch(prompts(LENGTHS[:3], seed=12), SamplingParams(max_tokens=4, temperature=0), timeout=300)
    front.generate_batch(prompts(LENGTHS[:1], seed=13), SamplingParams(max_tokens=1, temperature=0), timeout=300)
    assert sample("neuron_serve_request_queue_time_seconds_count") == queued + 4  # one a request, at its prefill
    # Every step with a call: at least 4 (a prefill and 3 decodes), each with time on both sides.
    assert sample("neuron_serve_generation_step_host_seconds_count") >= steps + 4
    assert sample("neuron_serve_generation_step_host_seconds_sum") > host
    assert sample("neuron_serve_generation_step_core_wait_seconds_sum") > core


def test_seeded_sampled_prompts_prefilled_together_take_the_tokens_they_take_alone(served):
    _, front = served
    asked = prompts(LENGTHS[:4], seed=8)
    params = [SamplingParams(max_tokens=8, temperature=0.9, top_p=0.95, seed=100 + i) for i in range(4)]
    before = calls("prefill_4x16")
    together = front.generate_batch(asked, params, timeout=300)
    assert calls("prefill_4x16") == before + 1
    alone = [front.generate_batch([p], q, timeout=300)[0] for p, q in zip(asked, params)]
    assert [d.tokens for d in together] == [d.tokens for d in alone]
    assert len({tuple(d.tokens) for d in together}) == 4


def test_a_prompt_whose_prefix_another_prompt_of_its_step_writes_is_prefilled_after_it(served):
    """With prefix caching, a prompt sharing a whole block with a prompt admitted before it in the same step copies
    that slot once the batch has written it, then computes only its own rest."""
    lm, front = served
    shared = prompts((16,), seed=9)[0]
    asked = [shared + [5, 6], prompts((4,), seed=10)[0], shared + [7, 8, 9], prompts((12,), seed=11)[0]]
    hits = REGISTRY.get_sample_value("neuron_serve_prefix_cache_hits_total", {"model_name": NAME, "replica": "0"}) or 0
    done = front.generate_batch(asked, SamplingParams(max_tokens=5, temperature=0), timeout=300)
    assert [d.tokens for d in done] == [gm.eager_greedy(lm, p, 5) for p in asked]
    now = REGISTRY.get_sample_value("neuron_serve_prefix_cache_hits_total", {"model_name": NAME, "replica": "0"})
    assert now - hits == 16


def test_rows_of_one_call_end_each_on_its_own_stop_and_free_their_slots(served):
    """A stop token in one row's first token (from the batched call), another's in a later decode, a third by
    max_tokens: each ends there, with its finish reason, and the others go on."""
    lm, front = served
    asked = prompts((6, 13, 9, 15), seed=14)
    want = [gm.eager_greedy(lm, p, 8) for p in asked]
    params = [SamplingParams(max_tokens=8, temperature=0, stop_token_ids=[want[0][0]]),  # its first token
              SamplingParams(max_tokens=8, temperature=0, stop_token_ids=[want[1][3]]),
              SamplingParams(max_tokens=2, temperature=0),
              SamplingParams(max_tokens=8, temperature=0)]
    before = calls("prefill_4x16")
    done = front.generate_batch(asked, params, timeout=300)
    assert calls("prefill_4x16") == before + 1
    ends = [want[1].index(want[1][3]) + 1]
    assert [d.tokens for d in done] == [want[0][:1], want[1][:ends[0]], want[2][:2], want[3]]
    assert [(d.finish_reason, d.stop_reason) for d in done] == [
        ("stop", want[0][0]), ("stop", want[1][3]), ("length", None), ("length", None)]
    assert front.engines.running == 0 and front.engines.free_slots == 4
