"""Chunked prefill served by one engine: long prompts written chunk by chunk in the same compiled calls as the
running sequences' decodes, every answer transformers' own (greedy token for token, sampled by seed as the core
draws), with prefix caching and LoRA adapters; the step's token budget read from the engine's step log."""

from __future__ import annotations

import threading

import pytest
import torch
from prometheus_client import REGISTRY

import generation_models as gm
from neuron_serve.config.schema import parse_config
from neuron_serve.errors import ConfigError
from neuron_serve.generation import SamplingParams, engine_for
from neuron_serve.generation.compiling.build import build_engine

BUDGET = 12  # tokens a step: a decode row each, then a chunk of 4 or 8 tokens (the compiled chunk lengths)
SHAPES = {"max_num_seqs": 4, "max_model_len": 64, "prefill_buckets": [64], "decode_batch_buckets": [4],
          "decode_context_buckets": [64]}
CHUNKED = {"enable_chunked_prefill": True, "prefill_chunk_buckets": [4, 8], "max_num_batched_tokens": BUDGET}


def prompts(lengths, seed: int = 5) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(1, gm.VOCAB, (n,), generator=generator).tolist() for n in lengths]


@pytest.fixture(scope="module")
def served():
    """The tiny Llama with chunked prefill (mixed models of 4 and 8 chunk tokens beside 4 rows), prefix caching and
    sampling on the core."""
    lm = gm.build("llama")
    # Async scheduling on (off by default on emulated cores): decodes launched ahead between the mixed calls.
    front = engine_for(lm, **SHAPES, **CHUNKED, enable_prefix_caching=True, name="chunked", async_scheduling=True)
    yield front, lm
    front.close()


def _chunks(engine, since: int) -> list[tuple[int, int, int]]:
    return list(engine.step_log)[since:]


def test_long_prompts_chunked_beside_decoding_streams_answer_as_transformers(served):
    front, lm = served
    engine = front.engines
    since = len(engine.step_log)
    # Two streams decode throughout while prompts of 9 to 41 tokens arrive: chunks of 1 to 8 tokens, in the 4- and
    # 8-token mixed models, beside 1 to 3 decode rows.
    running = prompts((3, 6), seed=1)
    long = prompts((9, 13, 22, 30, 41), seed=2)
    done = front.generate_batch([*running, *long], [SamplingParams(max_tokens=40, temperature=0)] * 2 +
                                [SamplingParams(max_tokens=8, temperature=0)] * 5, timeout=300)
    assert [d.tokens for d in done[:2]] == [gm.eager_greedy(lm, p, 40) for p in running]
    assert [d.tokens for d in done[2:]] == [gm.eager_greedy(lm, p, 8) for p in long]
    steps = _chunks(engine, since)
    assert all(prompt + decode <= BUDGET for prompt, decode, _ in steps)  # the budget, every step
    chunk_lengths = {chunk for _, _, chunk in steps if chunk}
    assert chunk_lengths & {1, 2, 3, 4} and chunk_lengths & {5, 6, 7, 8}  # both compiled chunk lengths ran
    assert any(chunk and decode >= 2 for _, decode, chunk in steps)  # chunks beside decoding streams


def test_a_sampled_chunked_prompt_draws_what_eager_sampling_draws_alone_and_beside_others(served):
    front, lm = served
    prompt = prompts((27,), seed=3)[0]
    params = SamplingParams(max_tokens=10, temperature=0.8, top_p=0.9, seed=17)
    [alone] = front.generate_batch([prompt], params, timeout=300)
    mixed = front.generate_batch([*prompts((2, 5), seed=4), prompt],
                                 [SamplingParams(max_tokens=20, temperature=0), SamplingParams(max_tokens=20,
                                                                                               temperature=1, seed=3),
                                  params], timeout=300)
    assert alone.tokens == mixed[2].tokens == gm.eager_sampled(lm, prompt, 10, params)


def test_a_cached_prefix_is_not_chunked_again_and_the_rest_is(served):
    front, lm = served
    engine = front.engines
    shared = prompts((40,), seed=6)[0]
    hits = REGISTRY.get_sample_value("neuron_serve_prefix_cache_hits_total",
                                     {"model_name": "chunked", "replica": "0"}) or 0.0
    [first] = front.generate_batch([shared + [7, 9]], SamplingParams(max_tokens=6, temperature=0), timeout=300)
    since = len(engine.step_log)
    background = threading.Thread(target=front.generate_batch, args=([prompts((2,), seed=8)[0]],
                                                                      SamplingParams(max_tokens=30, temperature=0)),
                                   kwargs={"timeout": 300})
    background.start()  # a stream decoding meanwhile, so the rest goes in chunks
    [again] = front.generate_batch([shared + [11, 12, 13]], SamplingParams(max_tokens=6, temperature=0),
                                   timeout=300)
    background.join()
    assert first.tokens == gm.eager_greedy(lm, shared + [7, 9], 6)
    assert again.tokens == gm.eager_greedy(lm, shared + [11, 12, 13], 6)
    reused = (REGISTRY.get_sample_value("neuron_serve_prefix_cache_hits_total",
                                        {"model_name": "chunked", "replica": "0"}) or 0.0) - hits
    assert reused == 32  # two whole blocks of 16 of the 40 shared tokens
    # Only the 11 tokens after the cached prefix (and the background stream's prompt) were computed.
    assert sum(prompt for prompt, _, _ in _chunks(engine, since)) == 11 + 2


def test_prompt_logprobs_of_a_long_prompt_are_eagers(served):
    """A prompt asking for its logprobs is prefilled whole (its compiled model keeps every position's logits), even
    beside decoding streams and past the step's budget."""
    front, lm = served
    prompt = prompts((30,), seed=9)[0]
    done = front.generate_batch([prompts((3,), seed=10)[0], prompt],
                                [SamplingParams(max_tokens=20, temperature=0),
                                 SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=0)], timeout=300)
    got = [lp[0] for lp in done[1].prompt_logprobs[1:]]
    with torch.no_grad():
        want = torch.log_softmax(lm(torch.tensor([prompt])).logits[0].float(), -1)
    assert got == pytest.approx([float(want[i, prompt[i + 1]]) for i in range(len(prompt) - 1)], abs=1e-4)
    assert done[1].tokens == gm.eager_greedy(lm, prompt, 2)


def test_the_metrics_count_tokens_by_kind_chunked_steps_and_inter_token_latency(served):
    labels = {"model_name": "chunked", "replica": "0"}
    assert REGISTRY.get_sample_value("neuron_serve_chunked_prefill_steps_total", labels) > 0
    assert REGISTRY.get_sample_value("neuron_serve_iteration_tokens_sum", {**labels, "kind": "prompt"}) > 0
    assert REGISTRY.get_sample_value("neuron_serve_iteration_tokens_sum", {**labels, "kind": "decode"}) > 0
    assert REGISTRY.get_sample_value("neuron_serve_inter_token_latency_seconds_count", labels) > 0


def test_lora_adapters_run_in_chunks_each_row_and_the_chunk_under_its_own(tmp_path):
    adapters = {"attention": {"r": 4, "lora_alpha": 8, "target_modules": gm.ATTENTION},
                "mlp": {"r": 8, "lora_alpha": 16, "target_modules": gm.MLP}}
    lm, peft = gm.base_and_adapters(tmp_path, adapters)
    config = parse_config({"name": "lora", "task": "generate", "model": {"pretrained": "llama"},
                           "generation": {**SHAPES, **CHUNKED, "on_device_sampling": False,
                                          "lora": {"max_loras": 2, "max_lora_rank": 8,
                                                   "lora_modules": {n: n for n in adapters}}}})
    front = build_engine(config, tmp_path)
    names = ["attention", None, "mlp", "attention"]
    lengths = (3, 29, 17, 2)
    try:
        done = front.generate_batch(prompts(lengths, seed=11), [SamplingParams(max_tokens=m, temperature=0)
                                                                 for m in (30, 6, 6, 30)],
                                    adapters=names, timeout=300)
        steps = list(front.engines.engines[0].step_log)
    finally:
        front.close()
    for completion, name, prompt, new in zip(done, names, prompts(lengths, seed=11), (30, 6, 6, 30)):
        model = lm if name is None else peft[name]
        assert completion.tokens == gm.eager_greedy(model, prompt, new)
    assert any(chunk for _, _, chunk in steps)


def test_what_chunked_prefill_cannot_do_is_refused_by_name():
    base = {"name": "c", "task": "generate", "model": {"factory": "generation_models:build",
                                                         "kwargs": {"arch": "llama"}}}
    with pytest.raises(ConfigError) as both:
        parse_config({**base, "generation": {**SHAPES, **CHUNKED, "speculative_config": {
            "method": "ngram", "num_speculative_tokens": 2}}})
    assert ("generation.enable_chunked_prefill: not with speculative_config (a step verifies proposals or carries a "
            "prompt's chunk, not both yet); turn one off") in str(both.value)
    with pytest.raises(ConfigError) as small:
        parse_config({**base, "generation": {**SHAPES, **CHUNKED, "max_num_batched_tokens": 4}})
    assert "generation.max_num_batched_tokens: 4 leaves no prompt token beside 4 decode rows" in str(small.value)
    with pytest.raises(ConfigError) as alone:
        parse_config({**base, "generation": {**SHAPES, "long_prefill_token_threshold": 64}})
    assert "generation.long_prefill_token_threshold: applies with enable_chunked_prefill: true" in str(alone.value)
    with pytest.raises(ConfigError) as gpt2:
        engine_for(gm.build("gpt2"), **SHAPES, **CHUNKED)
    assert str(gpt2.value).startswith("enable_chunked_prefill: a mixed call splits attention between decode rows "
                                      "and a prompt's chunk, which needs Llama-style attention")
