"""Per-request sampling parameters, and the token choice of a row whose logits need the host.

Temperature, top-k, top-p and min-p are applied on the core (``sampler.py``). A row
needs its logits on the host only for what depends on more than them:

- repetition, presence and frequency penalties (the tokens the sequence holds),
- a logit bias and ``min_tokens``' ban of the end tokens (a few ids of a row),
- a structured output's grammar (xgrammar walks it on the host, token by token),
- log-probabilities (the top n need a sort of the vocabulary, which neuronx-cc has not;
  the chosen token's comes with them, from the same logits).

There :func:`sample_row` applies them, then chooses as the core would
(``sampler.choose_on_host``), from the same random stream: a seed gives the same tokens
whichever side chose them. Log-probabilities are those of the model's distribution
(before temperature, penalties and truncation), as vLLM and OpenAI report them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ...errors import InvalidInput
from .sampler import GREEDY, RowChoice, choose_on_host

MAX_LOGPROBS = 20


@dataclass(frozen=True)
class SamplingParams:
    """How one request's tokens are chosen and when it stops (vLLM's names)."""

    max_tokens: int | None = None  # None: until the context (max_model_len) is full
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: no limit
    min_p: float = 0.0  # tokens below min_p times the likeliest token's probability are dropped
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # top-n log-probabilities per token (0: only the chosen token's)
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias in [-100, 100]) added to the logits
    min_tokens: int = 0  # EOS and stop_token_ids are banned until this many tokens are generated
    prompt_logprobs: int | None = None  # vLLM's: each prompt token's logprob and the top-n at its position
    structured: Any = None  # a structured.Constraint: the answer held to a schema, regex, choice or grammar

    def __post_init__(self) -> None:
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
        object.__setattr__(self, "logit_bias", tuple((int(t), float(b)) for t, b in bias))
        checks = [
            (self.max_tokens is None or (isinstance(self.max_tokens, int) and self.max_tokens >= 1)
             or (self.max_tokens == 0 and self.prompt_logprobs is not None), "max_tokens",
             "an integer >= 1, or None (until the context is full); 0 only with prompt_logprobs"),
            (self.temperature >= 0, "temperature", ">= 0 (0 is greedy)"),
            (0 < self.top_p <= 1, "top_p", "in (0, 1]"),
            (isinstance(self.top_k, int) and self.top_k >= 0, "top_k", "an integer >= 0 (0: no limit)"),
            (0 <= self.min_p <= 1, "min_p", "in [0, 1]"),
            (self.repetition_penalty > 0, "repetition_penalty", "> 0 (1 is none)"),
            (-2 <= self.presence_penalty <= 2, "presence_penalty", "in [-2, 2]"),
            (-2 <= self.frequency_penalty <= 2, "frequency_penalty", "in [-2, 2]"),
            (self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS, "logprobs", f"in [0, {MAX_LOGPROBS}]"),
            (isinstance(self.min_tokens, int) and self.min_tokens >= 0, "min_tokens", "an integer >= 0"),
            (self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= MAX_LOGPROBS, "prompt_logprobs",
             f"in [0, {MAX_LOGPROBS}]"),
            (self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens", "at most max_tokens"),
            (all(-100 <= b <= 100 for _, b in self.logit_bias), "logit_bias",
             "a bias in [-100, 100] for each token id"),
        ]
        for ok, name, want in checks:
            if not ok:
                raise InvalidInput(f"{name} must be {want}, got {getattr(self, name)!r}.")
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))

        object.__setattr__(self, "stop", tuple(s for s in self.stop if s))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalized(self) -> bool:
        return self.repetition_penalty != 1 or self.presence_penalty != 0 or self.frequency_penalty != 0

    def on_host(self, generated: int) -> bool:
        """Whether the next token needs the row's logits on the host (see the module docstring): penalties,
        a logit bias, end tokens still banned by ``min_tokens``, a grammar, or logprobs."""
        return (self.logprobs is not None or self.penalized or bool(self.logit_bias)
                or generated < self.min_tokens or self.structured is not None)

    def choice(self, counter: int) -> RowChoice:
        """The core's parameters for the token of index ``counter`` of the output (the seed is the front
        end's: a request without one has one drawn for it)."""
        if self.greedy:
            return GREEDY
        return RowChoice(self.temperature, self.top_p, self.min_p, self.top_k,
                         self.seed if self.seed is not None else 0, counter)


@dataclass
class Sampled:
    """One row's choice: the token, its log-probability and the top-n alternatives."""

    token: int
    logprob: float | None = None
    top: list[tuple[int, float]] = field(default_factory=list)


def _penalize(logits: torch.Tensor, params: SamplingParams, prompt: list[int], output: list[int]) -> torch.Tensor:
    logits = logits.clone()
    if params.repetition_penalty != 1:
        seen = torch.tensor(sorted(set(prompt) | set(output)), dtype=torch.long)
        if len(seen):
            values = logits[seen]
            logits[seen] = torch.where(values > 0, values / params.repetition_penalty,
                                       values * params.repetition_penalty)
    if output and (params.presence_penalty or params.frequency_penalty):
        counts = torch.bincount(torch.tensor(output, dtype=torch.long), minlength=logits.shape[-1]).to(logits.dtype)
        logits -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


def _bias(logits: torch.Tensor, params: SamplingParams, output: list[int], ends: frozenset[int]) -> torch.Tensor:
    """``logit_bias`` added, and the end tokens banned while fewer than ``min_tokens`` are generated."""
    if not params.logit_bias and len(output) >= params.min_tokens:
        return logits
    logits = logits.clone()
    for token, bias in params.logit_bias:
        logits[token] += bias
    if len(output) < params.min_tokens:
        banned = [t for t in (ends | frozenset(params.stop_token_ids)) if 0 <= t < logits.shape[-1]]
        logits[banned] = float("-inf")
    return logits


def sample_row(logits: torch.Tensor, params: SamplingParams, prompt: list[int], output: list[int],
               ends: frozenset[int] = frozenset(), constraint: Any = None) -> Sampled:
    """Choose the next token of one sequence from its logits (vocab,); ``ends`` are the model's EOS ids,
    ``constraint`` its structured-output grammar (a structured.RowConstraint), which masks the logits."""
    logits = logits.float()
    chosen_from = _bias(logits, params, output, frozenset() if params.ignore_eos else ends)
    if constraint is not None:
        chosen_from = constraint.mask(chosen_from.clone() if chosen_from is logits else chosen_from)
    chosen_from = _penalize(chosen_from, params, prompt, output) if params.penalized else chosen_from
    token = choose_on_host(chosen_from, params.choice(len(output)))
    if params.logprobs is None:
        return Sampled(token)
    logprobs = torch.log_softmax(logits, dim=-1)
    top = []
    if params.logprobs:
        values, ids = torch.topk(logprobs, params.logprobs)
        top = [(int(i), float(v)) for i, v in zip(ids, values)]
        if token not in ids:  # as OpenAI, the chosen token is always among them
            top.append((token, float(logprobs[token])))
    return Sampled(token, float(logprobs[token]), top)


def prompt_logprobs(prompt: list[int], logits: torch.Tensor, top_n: int) -> list[Sampled | None]:
    """Each prompt token's log-probability given the tokens before it, with the ``top_n`` at its position
    (the token itself always among them, as OpenAI lists them); None for the first token, which has none."""
    logprobs = torch.log_softmax(logits[:-1].float(), dim=-1)  # position i predicts token i + 1
    targets = torch.as_tensor(prompt[1:], dtype=torch.long)
    chosen = logprobs.gather(1, targets[:, None])[:, 0].tolist()
    scored: list[Sampled | None] = [None]
    tops = torch.topk(logprobs, top_n) if top_n else None
    for i, (token, logprob) in enumerate(zip(prompt[1:], chosen)):
        top = []
        if tops is not None:
            top = [(int(t), float(v)) for t, v in zip(tops.indices[i], tops.values[i])]
            if token not in (t for t, _ in top):
                top.append((token, logprob))
        scored.append(Sampled(token, logprob, top))
    return scored
