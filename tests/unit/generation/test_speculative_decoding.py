"""Speculative decoding (n-gram proposals): greedy output is exactly the model's, sampled output is exactly
what one step at a time samples (so it keeps its distribution), and the metrics count what was proposed
and accepted."""

from __future__ import annotations

import pytest
import torch
from prometheus_client import REGISTRY

import generation_models as gm
from neuron_serve.errors import ConfigError
from neuron_serve.config.schema import parse_config
from neuron_serve.generation import SamplingParams, engine_for
from neuron_serve.generation.spec_decode.proposer import ngram_proposals

K = 3
# One context bucket: what is checked is the rounds (proposals, verify, rejection), not bucket choice.
SHAPES = {"max_num_seqs": 4, "max_model_len": 96, "prefill_buckets": [16, 96], "decode_batch_buckets": [1, 4],
          "decode_context_buckets": [96], "decode_steps": 2,
          "speculative_config": {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": 3}}


@pytest.fixture(scope="module")
def speculating():
    lm = gm.build("llama")
    tokenizer = gm.byte_tokenizer()
    engine = engine_for(lm, name="speculative", tokenizer=tokenizer, **SHAPES)
    yield lm, engine, tokenizer
    engine.close()


def counted(name: str) -> float:
    return REGISTRY.get_sample_value(f"neuron_serve_spec_decode_num_{name}_total",
                                     {"model_name": "speculative", "replica": "0"}) or 0.0


def repetitive(seed: int, length: int) -> list[int]:
    """A prompt that repeats a short random phrase, so earlier n-grams recur."""
    phrase = torch.randint(1, gm.VOCAB, (5,), generator=torch.Generator().manual_seed(seed)).tolist()
    return (phrase * (length // 5 + 1))[:length]


def test_greedy_output_is_the_models_with_proposals_accepted_and_rejected(speculating):
    lm, engine, _ = speculating
    prompts = [repetitive(i, n) for i, n in enumerate((12, 30, 7, 41, 20))]
    new = [40, 25, 33, 18, 44]
    drafted, accepted = counted("draft_tokens"), counted("accepted_tokens")
    done = engine.generate_batch(prompts, [SamplingParams(max_tokens=n, temperature=0) for n in new])
    assert [c.tokens for c in done] == [gm.eager_greedy(lm, p, n) for p, n in zip(prompts, new)]
    drafted, accepted = counted("draft_tokens") - drafted, counted("accepted_tokens") - accepted
    assert 0 < accepted < drafted  # proposals were taken, and some were not
    per_position = [REGISTRY.get_sample_value("neuron_serve_spec_decode_num_accepted_tokens_per_pos_total", {
        "model_name": "speculative", "replica": "0", "position": str(i)}) for i in range(K)]
    assert per_position[0] >= per_position[1] >= per_position[2] and per_position[K - 1] > 0  # all k accepted


def test_sequences_end_mid_round_on_stop_tokens_stop_strings_and_max_tokens(speculating):
    lm, engine, tokenizer = speculating
    prompt = repetitive(7, 25)
    want = gm.eager_greedy(lm, prompt, 30)
    stop_at = want[9]
    by_token = engine.generate_batch([prompt], [SamplingParams(max_tokens=30, temperature=0,
                                                               stop_token_ids=(stop_at,))])[0]
    assert by_token.tokens == want[:want.index(stop_at) + 1] and by_token.finish_reason == "stop"
    text = tokenizer.decode(want)
    stop = text[len(tokenizer.decode(want[:12])):][:2]
    by_text = engine.generate_batch([prompt], [SamplingParams(max_tokens=30, temperature=0, stop=(stop,))])[0]
    assert by_text.finish_reason == "stop" and by_text.text == text[:text.index(stop)]
    for n in (1, 2, 5):
        short = engine.generate_batch([prompt], [SamplingParams(max_tokens=n, temperature=0)])[0]
        assert short.tokens == want[:n] and short.finish_reason == "length"


def test_sampled_rows_and_host_rows_share_the_verify_call(speculating):
    lm, engine, _ = speculating
    prompts = [repetitive(20 + i, 30) for i in range(3)]
    params = [SamplingParams(max_tokens=20, temperature=0.8, seed=5), SamplingParams(max_tokens=20, temperature=0),
              SamplingParams(max_tokens=20, temperature=0, logprobs=2)]  # logprobs: no proposals for that row
    drafts = counted("drafts")
    first = engine.generate_batch(prompts, params)
    assert counted("drafts") > drafts  # rounds with proposals ran, the logprobs row in their calls
    again = engine.generate_batch(prompts, params)
    assert [c.tokens for c in first] == [c.tokens for c in again]  # a seeded sample is reproducible
    assert first[1].tokens == gm.eager_greedy(lm, prompts[1], 20)
    assert first[2].tokens == gm.eager_greedy(lm, prompts[2], 20) and len(first[2].logprobs) == 20


def test_sampled_output_is_what_one_step_at_a_time_samples(speculating):
    """A proposal is taken when the model's own sampled choice there equals it, and each position samples
    with its token's index: the same seed gives the tokens eager sampling gives, whatever was proposed."""
    lm, engine, _ = speculating
    prompts = [repetitive(40 + i, 30) for i in range(3)]
    # Cool enough that the repetition the proposals copy is often what the model samples too.
    params = [SamplingParams(max_tokens=24, temperature=t, top_p=p, seed=s)
              for t, p, s in ((0.01, 1.0, 1), (0.02, 0.9, 2), (0.05, 0.95, 3))]
    drafted, accepted = counted("draft_tokens"), counted("accepted_tokens")
    done = engine.generate_batch(prompts, params)
    assert counted("accepted_tokens") > accepted and counted("draft_tokens") > drafted
    assert [c.tokens for c in done] == [gm.eager_sampled(lm, p, 24, s) for p, s in zip(prompts, params)]


def test_ngram_lookup():
    assert ngram_proposals([1, 2, 3, 9, 1, 2, 3, 8, 1, 2], 3, 1, 3) == [3, 8, 1]  # the latest earlier match
    assert ngram_proposals([4, 7, 4, 7, 4, 7, 4], 3, 1, 2) == [7, 4, 7]  # one followed by k tokens, in a loop
    assert ngram_proposals([1, 2, 3, 4], 3, 1, 3) == []
    assert ngram_proposals([5, 6, 5], 4, 1, 2) == [6, 5]  # no occurrence has k after it: the one with most


def test_bad_speculative_settings_name_their_field():
    base = {"name": "m", "task": "generate", "model": {"pretrained": "d"}}
    for given, expected in [
        ({"num_speculative_tokens": 0}, "generation.speculative_config.num_speculative_tokens: Input should be "
                                        "greater than or equal to 1"),
        ({"num_speculative_tokens": 2, "method": "eagle"}, "generation.speculative_config.method: Input should be "
                                                           "'ngram'"),
        ({"num_speculative_tokens": 2, "prompt_lookup_min": 5, "prompt_lookup_max": 2},
         "generation.speculative_config.prompt_lookup_min: 5 is more than prompt_lookup_max (2)"),
        ({"num_speculative_tokens": 2, "method": "draft_model"},
         "generation.speculative_config.model: method draft_model needs the draft's directory"),
        ({"num_speculative_tokens": 2, "method": "ngram", "model": "draft"},
         "generation.speculative_config.model: applies to method draft_model"),
    ]:
        with pytest.raises(ConfigError) as caught:
            parse_config({**base, "generation": {"speculative_config": given}})
        assert expected in str(caught.value)
    assert parse_config({**base, "generation": {"speculative_config": {
        "num_speculative_tokens": 2, "model": "draft"}}}).generation.speculative_config.method == "draft_model"


def test_a_draft_of_another_vocabulary_or_beside_prefix_caching_is_refused():
    from neuron_serve.generation.compiling.build import check_draft  # noqa: PLC0415

    lm = gm.build("llama")
    with pytest.raises(ConfigError) as other:
        check_draft(lm, gm.build("llama", vocab_size=300))
    assert str(other.value) == ("generation.speculative_config.model: the draft's vocabulary has 300 tokens and the "
                                "model's 256; a draft must share the model's tokenizer and vocabulary.")
    with pytest.raises(ConfigError) as cached:
        check_draft(lm, gm.build("llama"), prefix_caching=True)
    assert str(cached.value).startswith("generation.enable_prefix_caching: not with a draft model")


DRAFT_SHAPES = {k: v for k, v in SHAPES.items() if k not in ("speculative_config", "decode_steps")}


@pytest.mark.parametrize("same", [True, False], ids=["draft-is-the-model", "draft-disagrees"])
def test_a_draft_models_proposals_keep_greedy_output(same):
    lm = gm.build("llama")
    draft = gm.build("llama") if same else gm.build("qwen2", seed=3)  # the same weights, or other ones
    engine = engine_for(lm, name=f"draft-{same}", draft=draft, speculative_config={"num_speculative_tokens": K},
                        **DRAFT_SHAPES)
    try:
        prompts = [repetitive(30 + i, n) for i, n in enumerate((9, 22, 15))]
        new = [30, 17, 41]
        done = engine.generate_batch(prompts, [SamplingParams(max_tokens=n, temperature=0) for n in new])
        assert [c.tokens for c in done] == [gm.eager_greedy(lm, p, n) for p, n in zip(prompts, new)]
        labels = {"model_name": f"draft-{same}", "replica": "0"}
        drafted = REGISTRY.get_sample_value("neuron_serve_spec_decode_num_draft_tokens_total", labels)
        accepted = REGISTRY.get_sample_value("neuron_serve_spec_decode_num_accepted_tokens_total", labels)
        if same:
            assert accepted == drafted > 0  # the model agrees with itself on every proposal
        else:
            assert accepted < drafted / 2
    finally:
        engine.close()
