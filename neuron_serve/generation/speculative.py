"""Speculative decoding: proposals for each running sequence, and which of them the model accepts.

Each round, a sequence gets up to k proposed tokens; one verify call runs its last token
and the proposals through the model at once, giving the model's logits after each. The
proposals are deterministic (a draft's choice is certain), so acceptance is the standard
rule of speculative sampling with a one-hot proposal distribution:

- a greedy sequence accepts proposals while each equals the model's argmax, then takes the
  model's argmax at the first mismatch (or after the last proposal): exactly the model's
  greedy output, one to k + 1 tokens a round;
- a sampled sequence accepts proposal d with probability p(d) under the model's
  distribution (temperature, top-k and top-p applied); on a rejection it samples from p
  with d removed, renormalized; after k acceptances it samples one more token from p.
  Each token's distribution is therefore the model's own (Leviathan et al., 2023; Chen
  et al., 2023).

Sequences whose tokens need more of the host (penalties, a logit bias, logprobs, a
grammar, tokens under ``min_tokens``) get no proposals and take one token from the
call's first position, as a decode step gives it.

The n-gram proposer (vLLM's ``method: ngram``, prompt lookup decoding) copies the tokens
that followed the latest earlier occurrence of the sequence's last n tokens, for n from
``prompt_lookup_max`` down to ``prompt_lookup_min``: repetitive text (code edits,
extraction, summaries quoting their input) is proposed for free.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from .sampling import SamplingParams, _truncate


def ngram_proposals(tokens: Sequence[int], k: int, lookup_min: int, lookup_max: int) -> list[int]:
    """Up to ``k`` tokens that followed an earlier occurrence of the longest suffix of ``tokens`` (of
    ``lookup_max`` down to ``lookup_min`` tokens) found earlier; none when no suffix repeats.

    Of several occurrences, the latest one followed by k known tokens: in a loop of period
    shorter than k the latest occurrence is followed by less than a period of tokens, an
    earlier one by the whole k."""
    array = np.asarray(tokens, dtype=np.int64)
    length = len(array)
    for n in range(min(lookup_max, length - 1), lookup_min - 1, -1):
        windows = np.lib.stride_tricks.sliding_window_view(array[:length - 1], n)  # not the suffix itself
        hits = np.flatnonzero((windows == array[length - n:]).all(axis=1))
        if len(hits):
            full = hits[hits + n + k <= length]
            start = int(full[-1] if len(full) else hits[0]) + n
            return array[start:start + k].tolist()
    return []


def speculable(params: SamplingParams, generated: int) -> bool:
    """Whether a sequence's next tokens may be proposed: greedy or plain sampling, nothing else on the host."""
    return (params.logprobs is None and not params.penalized and not params.logit_bias
            and generated >= params.min_tokens and params.structured is None)


def accept_greedy(proposals: Sequence[int], argmax: Sequence[int]) -> list[int]:
    """The tokens a greedy sequence takes: the proposals matching the model's argmax, then the model's own."""
    taken = []
    for proposal, best in zip(proposals, argmax):
        if proposal != best:
            break
        taken.append(proposal)
    taken.append(int(argmax[len(taken)]))
    return taken


def accept_sampled(proposals: Sequence[int], logits: torch.Tensor, params: SamplingParams,
                   generator: torch.Generator | None) -> list[int]:
    """The tokens a sampled sequence takes from ``logits`` (k + 1, vocab) by rejection sampling (module docstring)."""
    taken = []
    for i, proposal in enumerate(proposals):
        probs = _probs(logits[i], params)
        if float(torch.rand((), generator=generator)) < float(probs[proposal]):
            taken.append(proposal)
            continue
        residual = probs.clone()
        residual[proposal] = 0
        if float(residual.sum()) <= 0:  # the model was certain of the proposal after all
            taken.append(proposal)
            continue
        taken.append(int(torch.multinomial(residual / residual.sum(), 1, generator=generator)))
        return taken
    taken.append(int(torch.multinomial(_probs(logits[len(proposals)], params), 1, generator=generator)))
    return taken


def _probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    return torch.softmax(_truncate(logits.float() / params.temperature, params.top_k, params.top_p), dim=-1)
