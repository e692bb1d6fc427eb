"""The host's sampler (penalties, bias, min_tokens, logprobs) and the scheduler on their own: no model, no core."""

from __future__ import annotations

import pytest
import torch

from neuron_serve.errors import InvalidInput
from dataclasses import replace

from neuron_serve.generation.sample.sampling import SamplingParams, sample_row

LOGITS = torch.tensor([2.0, 1.0, 0.5, -1.0, 3.0, 0.0])


def draws(params: SamplingParams, n: int = 200, prompt=(), output=()) -> set[int]:
    """The tokens ``n`` seeds draw."""
    return {sample_row(LOGITS, replace(params, seed=seed), list(prompt), list(output)).token for seed in range(n)}


def test_greedy_takes_the_largest_logit():
    assert sample_row(LOGITS, SamplingParams(temperature=0), [], []).token == 4


def test_top_k_and_top_p_keep_only_the_likeliest_tokens():
    assert draws(SamplingParams(temperature=1.0, top_k=1, seed=0)) == {4}
    assert draws(SamplingParams(temperature=1.0, top_k=2, seed=0)) == {4, 0}
    # p(4) = 0.61, p(0) = 0.22: top_p 0.5 keeps token 4 alone, 0.7 adds token 0.
    assert draws(SamplingParams(temperature=1.0, top_p=0.5, seed=0)) == {4}
    assert draws(SamplingParams(temperature=1.0, top_p=0.7, seed=0)) == {4, 0}
    assert len(draws(SamplingParams(temperature=5.0, seed=0))) == len(LOGITS)  # a hot draw reaches every token


def test_a_seed_repeats_its_draws_and_each_token_index_draws_anew():
    params = SamplingParams(temperature=1.5, seed=42)
    # The n-th token of a sequence draws from (seed, n): the same again, whatever came before it.
    first = [sample_row(LOGITS, params, [], [0] * n).token for n in range(20)]
    assert first == [sample_row(LOGITS, params, [], [1] * n).token for n in range(20)]
    assert len(set(first)) > 1


def test_penalties_move_the_choice_off_repeated_tokens():
    # Token 4 leads token 0 by 1.0: a repetition penalty of 2 (3.0 -> 1.5) or a frequency
    # penalty of 0.6 for two occurrences puts token 0 first.
    assert sample_row(LOGITS, SamplingParams(temperature=0, repetition_penalty=2.0), [4], []).token == 0
    assert sample_row(LOGITS, SamplingParams(temperature=0, frequency_penalty=0.6), [], [4, 4]).token == 0
    assert sample_row(LOGITS, SamplingParams(temperature=0, frequency_penalty=0.6), [], [4]).token == 4
    assert sample_row(LOGITS, SamplingParams(temperature=0, presence_penalty=1.5), [], [4]).token == 0


def test_logprobs_are_the_models_own():
    expected = torch.log_softmax(LOGITS, -1)
    chosen = sample_row(LOGITS, SamplingParams(temperature=0, logprobs=3, repetition_penalty=2.0), [4], [])
    assert chosen.token == 0  # chosen under the penalty...
    assert chosen.logprob == pytest.approx(float(expected[0]))  # ...reported as the model gave it
    assert [t for t, _ in chosen.top] == [4, 0, 1]
    assert [v for _, v in chosen.top] == pytest.approx([float(expected[i]) for i in (4, 0, 1)])


@pytest.mark.parametrize(("field", "value", "message"), [
    ("max_tokens", 0, "max_tokens must be an integer >= 1, or None (until the context is full); 0 only with "
                      "prompt_logprobs, got 0."),
    ("top_p", 0.0, "top_p must be in (0, 1], got 0.0."),
    ("top_k", -1, "top_k must be an integer >= 0 (0: no limit), got -1."),
    ("presence_penalty", 3.0, "presence_penalty must be in [-2, 2], got 3.0."),
    ("logprobs", 21, "logprobs must be in [0, 20], got 21."),
])
def test_bad_parameters_are_refused_by_name(field, value, message):
    with pytest.raises(InvalidInput) as refused:
        SamplingParams(**{field: value})
    assert str(refused.value) == message


def test_the_chosen_token_is_always_among_the_top_logprobs():
    # Sampled at a high temperature until a token outside the top 2 comes up: it is listed with its logprob.
    params = SamplingParams(temperature=2.0, logprobs=2)
    expected = torch.log_softmax(LOGITS, -1)
    for seed in range(200):
        chosen = sample_row(LOGITS, replace(params, seed=seed), [], [])
        if chosen.token not in (4, 0):
            break
    assert chosen.token not in (4, 0)
    assert chosen.top == [(4, pytest.approx(float(expected[4]))), (0, pytest.approx(float(expected[0]))),
                          (chosen.token, pytest.approx(float(expected[chosen.token])))]


def test_logit_bias_forces_and_bans_tokens_for_greedy_and_sampled_rows():
    assert sample_row(LOGITS, SamplingParams(temperature=0, logit_bias={3: 100.0}), [], []).token == 3
    assert sample_row(LOGITS, SamplingParams(temperature=0, logit_bias={4: -100.0}), [], []).token == 0
    assert draws(SamplingParams(temperature=1.0, seed=1, logit_bias={2: 100.0})) == {2}
    assert 4 not in draws(SamplingParams(temperature=1.0, seed=1, logit_bias={4: -100.0}))
    chosen = sample_row(LOGITS, SamplingParams(temperature=0, logprobs=0, logit_bias={3: 100.0}), [], [])
    assert chosen.logprob == pytest.approx(float(torch.log_softmax(LOGITS, -1)[3]))  # the model's own, unbiased
    assert SamplingParams(temperature=0, logit_bias={3: 1.0}).on_host(0)  # the core's argmax is not the choice


def test_min_tokens_bans_eos_and_stop_token_ids_until_reached():
    ends = frozenset({4})
    params = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=(0,))
    assert sample_row(LOGITS, params, [], [], ends).token == 1  # 4 (EOS) and 0 (a stop id) banned
    assert sample_row(LOGITS, params, [], [7], ends).token == 1
    assert sample_row(LOGITS, params, [], [7, 7], ends).token == 4  # reached: EOS may come
    assert params.on_host(1) and not params.on_host(2)
    ignoring = SamplingParams(temperature=0, min_tokens=2, ignore_eos=True)
    assert sample_row(LOGITS, ignoring, [], [], ends).token == 4


@pytest.mark.parametrize(("fields", "message"), [
    ({"logit_bias": {1: 101.0}}, "logit_bias must be a bias in [-100, 100] for each token id, got ((1, 101.0),)."),
    ({"min_tokens": 5, "max_tokens": 3}, "min_tokens must be at most max_tokens, got 5."),
])
def test_bad_bias_and_min_tokens_are_refused_by_name(fields, message):
    with pytest.raises(InvalidInput) as refused:
        SamplingParams(**fields)
    assert str(refused.value) == message
