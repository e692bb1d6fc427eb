"""Per-request sampling: parameters, checked at submission, and the sampler applied to a step's logits.

Every running sequence of a decode step carries its own parameters; the sampler
works on the step's logits on the host (the decode executable returns them), row by
row where parameters differ. A sampled request draws from its own
``torch.Generator``, seeded by ``seed``, so it gives the same tokens alone or in any
batch. Log-probabilities are those of the model's distribution (before temperature,
penalties and truncation), as vLLM and OpenAI report them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..errors import InvalidInput

MAX_LOGPROBS = 20


@dataclass(frozen=True)
class SamplingParams:
    """How one request's tokens are chosen and when it stops (vLLM's names)."""

    max_tokens: int | None = None  # None: until the context (max_model_len) is full
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: no limit
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # top-n log-probabilities per token (0: only the chosen token's)

    def __post_init__(self) -> None:
        checks = [
            (self.max_tokens is None or (isinstance(self.max_tokens, int) and self.max_tokens >= 1), "max_tokens",
             "an integer >= 1, or None (until the context is full)"),
            (self.temperature >= 0, "temperature", ">= 0 (0 is greedy)"),
            (0 < self.top_p <= 1, "top_p", "in (0, 1]"),
            (isinstance(self.top_k, int) and self.top_k >= 0, "top_k", "an integer >= 0 (0: no limit)"),
            (self.repetition_penalty > 0, "repetition_penalty", "> 0 (1 is none)"),
            (-2 <= self.presence_penalty <= 2, "presence_penalty", "in [-2, 2]"),
            (-2 <= self.frequency_penalty <= 2, "frequency_penalty", "in [-2, 2]"),
            (self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS, "logprobs", f"in [0, {MAX_LOGPROBS}]"),
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


def _truncate(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1:
        ordered, order = torch.sort(logits, descending=True)
        probs = torch.softmax(ordered, dim=-1)
        # Keep the smallest prefix whose probability reaches top_p (the first token always).
        drop = (probs.cumsum(-1) - probs) >= top_p
        logits = logits.clone()
        logits[order[drop]] = float("-inf")
    return logits


def sample_row(logits: torch.Tensor, params: SamplingParams, prompt: list[int], output: list[int],
               generator: torch.Generator | None) -> Sampled:
    """Choose the next token of one sequence from its logits (vocab,)."""
    logits = logits.float()
    chosen_from = _penalize(logits, params, prompt, output) if params.penalized else logits
    if params.greedy:
        token = int(chosen_from.argmax())
    else:
        scaled = _truncate(chosen_from / params.temperature, params.top_k, params.top_p)
        probs = torch.softmax(scaled, dim=-1)
        token = int(torch.multinomial(probs, 1, generator=generator))
    if params.logprobs is None:
        return Sampled(token)
    logprobs = torch.log_softmax(logits, dim=-1)
    top = []
    if params.logprobs:
        values, ids = torch.topk(logprobs, params.logprobs)
        top = [(int(i), float(v)) for i, v in zip(ids, values)]
    return Sampled(token, float(logprobs[token]), top)


def generator_for(params: SamplingParams) -> torch.Generator | None:
    """A request's own random stream: seeded when it asks, else from torch's global one."""
    if params.greedy:
        return None
    generator = torch.Generator()
    generator.manual_seed(params.seed if params.seed is not None else int(torch.randint(0, 2**62, ()).item()))
    return generator
