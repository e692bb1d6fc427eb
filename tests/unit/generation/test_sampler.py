"""The sampler the compiled calls end in, compiled through torch-xla as they compile it, many rows at once.

Its tokens must follow softmax(logits / T) restricted by min-p, top-k and top-p (vLLM's
order), with the rows the core leaves undone chosen on the host as the engine chooses
them; no token outside the allowed set may ever appear; a row's token must depend on its
seed, its token index and its logits only.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy import stats

import neuron_serve
from neuron_serve.generation.sample.sampler import RowChoice, row_parameters, sample, sample_on_host

VOCAB = 300
DRAWS = 8000
ALPHA = 1e-3  # the chance that a correct sampler fails the chi-square test


class Sampler(torch.nn.Module):
    def forward(self, logits, floats, ints):
        return sample(logits, floats, ints)


@pytest.fixture(scope="module")
def compiled():
    """The sampler compiled for DRAWS rows of VOCAB logits, as every sampled decode compiles it."""
    logits = torch.zeros(DRAWS, VOCAB)
    return neuron_serve.trace(Sampler(), (logits, *row_parameters([], DRAWS)))


def _logits(seed: int = 0) -> torch.Tensor:
    return torch.randn(VOCAB, generator=torch.Generator().manual_seed(seed)) * 2.0


def expected(logits: torch.Tensor, choice: RowChoice) -> np.ndarray:
    """The distribution the choice defines, in float64: T, then min-p, top-k, top-p over what is left."""
    probs = torch.softmax(logits.double() / choice.temperature, -1)
    probs = torch.where(probs >= choice.min_p * probs.max(), probs, 0.0)
    ordered, order = torch.sort(probs, descending=True)
    if choice.top_k:
        ordered[choice.top_k:] = 0
    before = ordered.cumsum(-1) - ordered
    ordered = torch.where(before < choice.top_p * ordered.sum(), ordered, 0.0)
    result = torch.zeros_like(probs)
    result[order] = ordered
    return (result / result.sum()).numpy()


def draw(compiled, logits: torch.Tensor, choice: RowChoice) -> tuple[np.ndarray, float]:
    """DRAWS tokens, one per seed, the engine's way: the core's, or the host's where the core left it;
    and the share the host chose."""
    choices = [RowChoice(choice.temperature, choice.top_p, choice.min_p, choice.top_k, seed, 0)
               for seed in range(DRAWS)]
    tokens, done = compiled(logits.expand(DRAWS, -1).contiguous(), *row_parameters(choices, DRAWS))
    tokens = tokens.clone()
    for row in torch.nonzero(~done).flatten().tolist():
        tokens[row] = sample_on_host(logits, choices[row])
    return tokens.numpy(), float((~done).float().mean())


def chi_square(counts: np.ndarray, probs: np.ndarray) -> tuple[float, float, np.ndarray]:
    """(statistic, the 1 - ALPHA critical value, the pooled expected counts) over the allowed tokens,
    the ones expected fewer than 5 times pooled into one cell."""
    allowed = probs > 0
    want, got = probs[allowed] * DRAWS, counts[allowed]
    small = want < 5
    cells_want = np.append(want[~small], want[small].sum()) if small.any() else want
    cells_got = np.append(got[~small], got[small].sum()) if small.any() else got
    statistic = float(((cells_got - cells_want) ** 2 / cells_want).sum())
    return statistic, float(stats.chi2.ppf(1 - ALPHA, len(cells_want) - 1)), cells_want


CHOICES = {
    "temperature": RowChoice(temperature=0.8),
    "min_p": RowChoice(temperature=1.0, min_p=0.05),
    "top_k": RowChoice(temperature=1.0, top_k=20),
    "top_p": RowChoice(temperature=0.7, top_p=0.9),
    "top_p_small": RowChoice(temperature=3.0, top_p=0.3),
    "min_p_top_p": RowChoice(temperature=1.2, min_p=0.02, top_p=0.8),
    "top_k_top_p": RowChoice(temperature=1.0, top_k=30, top_p=0.7),  # the host's, by design
}


@pytest.mark.parametrize("name", sorted(CHOICES))
def test_draws_follow_the_restricted_distribution_and_never_leave_it(compiled, name):
    choice = CHOICES[name]
    logits = _logits()
    probs = expected(logits, choice)
    tokens, on_host = draw(compiled, logits, choice)
    counts = np.bincount(tokens, minlength=VOCAB)
    assert counts[probs == 0].sum() == 0, f"tokens outside the allowed set: {np.flatnonzero(counts * (probs == 0))}"
    statistic, critical, cells = chi_square(counts, probs)
    assert statistic < critical, f"chi-square {statistic:.1f} >= {critical:.1f} ({len(cells)} cells)"
    # The power this test has: against a sampler that moves 3 points of probability from the likeliest allowed
    # token to the second, the statistic's noncentrality is DRAWS * sum((p' - p)^2 / p).
    first, second = np.argsort(-probs)[:2]
    shift = np.zeros_like(probs)
    shift[first], shift[second] = -0.03, 0.03
    noncentral = DRAWS * float((shift[probs > 0] ** 2 / probs[probs > 0]).sum())
    power = 1 - stats.ncx2.cdf(critical, len(cells) - 1, noncentral)
    assert power > 0.9
    if name == "top_k_top_p":
        assert on_host == 1.0  # top-p within the top k needs the k-th logit: the host sorts
    else:  # a draw is kept with the allowed set's share of what min-p leaves (at least top_p for top-p):
        loose = expected(logits, RowChoice(choice.temperature, min_p=choice.min_p))  # both fail with its square
        kept = float(loose[probs > 0].sum())
        assert on_host <= (1 - kept) ** 2 + 0.02
        assert choice.top_k or kept >= choice.top_p - 1e-9


def test_greedy_rows_take_the_first_largest_logit_as_argmax(compiled):
    logits = _logits(1).expand(DRAWS, -1).clone()
    logits[::2, 7] = logits[::2, 11] = logits.max() + 1  # a tie: argmax takes the first
    tokens, done = compiled(logits, *row_parameters([], DRAWS))
    assert torch.equal(tokens, logits.argmax(-1)) and bool(done.all())


def test_a_token_depends_on_its_seed_index_and_logits_only(compiled):
    """The same row in any company, at any place of the call, on the core or in eager torch, draws the same."""
    logits = torch.stack([_logits(seed) for seed in range(DRAWS)])
    choices = [RowChoice(temperature=1.0, top_p=0.9, top_k=0, seed=seed * 7919, counter=seed % 50)
               for seed in range(DRAWS)]
    tokens, _ = compiled(logits, *row_parameters(choices, DRAWS))
    order = torch.randperm(DRAWS, generator=torch.Generator().manual_seed(3))
    shuffled, _ = compiled(logits[order], *row_parameters([choices[i] for i in order.tolist()], DRAWS))
    assert torch.equal(shuffled, tokens[order])
    eager, _ = sample(logits, *row_parameters(choices, DRAWS))
    assert torch.equal(eager, tokens)
    later = [RowChoice(c.temperature, c.top_p, c.min_p, c.top_k, c.seed, c.counter + 1) for c in choices]
    moved, _ = compiled(logits, *row_parameters(later, DRAWS))
    assert (moved != tokens).float().mean() > 0.5  # the next token index draws anew


def test_the_host_choice_follows_the_same_distribution():
    logits, choice = _logits(2), RowChoice(temperature=0.9, top_k=40, top_p=0.8, min_p=0.01)
    probs = expected(logits, choice)
    tokens = np.array([sample_on_host(logits, RowChoice(0.9, 0.8, 0.01, 40, seed, 0)) for seed in range(DRAWS)])
    counts = np.bincount(tokens, minlength=VOCAB)
    assert counts[probs == 0].sum() == 0
    statistic, critical, _ = chi_square(counts, probs)
    assert statistic < critical
    assert math.isclose(counts.sum(), DRAWS)
